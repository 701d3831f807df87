"""Token-exact sessions on hand-built conversations, without HTTP: continuation, retries, a dropped turn (a new
segment, counted once), and the segment continued afterwards."""

from __future__ import annotations

import numpy as np

from arl.api import SampleOutput
from arl.models.tiny import build_char_tokenizer
from arl.rollout.ledger import EngineLog, verify_trajectory
from arl.api import GenerateRequest, GenerateResponse
from arl.rollout.sessions import Choice, Session, message_key

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


def enc(text: str) -> list[int]:
    return list(TOK.encode(text, add_special_tokens=False))


def answer(session: Session, log: EngineLog, messages: list[dict], text: str) -> dict:
    """Ask the session for the prompt ids, 'generate' `text`, record it; returns the assistant message."""
    ids, history, parent = session.chat_prompt(messages)
    out = enc(text) + [EOS]
    s = SampleOutput(out, np.full(len(out), -0.1, np.float32), [1] * len(out), "stop")
    log.add(GenerateRequest("q", ids), GenerateResponse("q", [s]))
    msg = {"role": "assistant", "content": text}
    session.record(ids, history, parent, [Choice(s, message_key(msg))])
    return msg


def test_continuation_retry_truncation_and_the_new_segment():
    s, log = Session("k", TOK), EngineLog()
    u1, u2, u3 = ({"role": "user", "content": c} for c in ("1+1=", "no", "again"))
    a1 = answer(s, log, [u1], "3")
    a2 = answer(s, log, [u1, a1, u2], "4")
    assert s.turns[1].prompt_ids.tolist() == enc("<|user|>1+1=<|assistant|>3") + [EOS] + enc("<|user|>no<|assistant|>")
    answer(s, log, [u1, a1, u2], "2")  # the same request again: a sibling of turn 2, same prompt ids
    assert s.turns[2].prompt_ids.tolist() == s.turns[1].prompt_ids.tolist() and s.mismatches == 0
    # the agent drops its first exchange (a summarising agent would): a new segment, counted once
    a3 = answer(s, log, [u2, a2, u3], "5")
    assert s.mismatches == 1 and s.turns[3].mismatch and s.turns[3].parent is None
    # and continues from there: token-exact within the new segment, no second mismatch
    answer(s, log, [u2, a2, u3, a3, u1], "2")
    assert s.mismatches == 1 and s.turns[4].parent == (s.turns[3], 0)
    trajs = s.trajectories(1.0, "g")
    # leaves: turn 2 ("4", continued by nobody), its retry sibling "2", and the new segment's last turn
    assert sorted((t.metadata["turns"], t.metadata["endpoint_prefix_mismatch"]) for t in trajs) == \
        [(2, 0), (2, 0), (2, 1)]
    for t in trajs:
        verify_trajectory(t, log)


def test_message_keys_ignore_ids_and_compare_tool_arguments_as_objects():
    a = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1, "y": 2}'}}]}
    b = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": {"y": 2, "x": 1}}}]}
    c = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 2, "y": 2}'}}]}
    assert message_key(a) == message_key(b) != message_key(c)
    assert message_key({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) == \
        message_key({"role": "user", "content": "ab"})


def test_an_edited_later_answer_is_a_prefix_mismatch_not_a_quiet_continuation_of_an_earlier_turn():
    """Turn 3 repeats turn 2's messages but replaces turn 2's answer: it rewrote history (the docs' prefix mismatch),
    so it starts a new segment, rendered whole, and is counted, rather than continuing turn 1 with the edited answer
    slipped in among the 'new' messages."""
    s, log = Session("k", TOK), EngineLog()
    u1, u2, u3 = ({"role": "user", "content": c} for c in ("1+1=", "no", "again"))
    a1 = answer(s, log, [u1], "3")
    answer(s, log, [u1, a1, u2], "4")
    edited = {"role": "assistant", "content": "2"}
    answer(s, log, [u1, a1, u2, edited, u3], "5")
    assert s.mismatches == 1 and s.turns[2].mismatch and s.turns[2].parent is None
    assert s.turns[2].prompt_ids.tolist() == enc("<|user|>1+1=<|assistant|>3<eos><|user|>no<|assistant|>2<eos>"
                                                 "<|user|>again<|assistant|>")
    # dropping the later answer altogether is the same rewrite
    answer(s, log, [u1, a1, u2, u3], "6")
    assert s.mismatches == 2 and s.turns[3].parent is None
    # a branch from an earlier answer that no later turn repeated is still a plain continuation
    answer(s, log, [u1, a1, u3], "7")
    assert s.mismatches == 2 and s.turns[4].parent == (s.turns[0], 0)
    trajs = s.trajectories(1.0, "g")
    assert sorted((t.metadata["turns"], t.metadata["endpoint_prefix_mismatch"]) for t in trajs) == \
        [(1, 1), (1, 1), (2, 0), (2, 0)]
    for t in trajs:
        verify_trajectory(t, log)
