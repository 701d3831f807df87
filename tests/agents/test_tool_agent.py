"""The tool agent against a scripted fake engine: tool calls, error observations, budgets, chain and tree shapes."""

import asyncio
import json

import numpy as np
import pytest

from arl.agents.tool_agent import ObservationEncoder, ToolAgent
from arl.api import GenerationConfig, SampleOutput
from arl.envs.math import MathEnv
from arl.models.tiny import TOOL_CHARS, build_char_tokenizer
from tests.agents.test_math_agents import FakeEngine

TOK = build_char_tokenizer(TOOL_CHARS)
EOS = TOK.eos_token_id
PROMPT = {"id": "p1", "prompt": "Tom has 12 apples and gets 7 more. How many?", "answer": "19"}
GCONF = GenerationConfig(max_new_tokens=96, temperature=1.0)


def enc(text):
    return TOK.encode(text, add_special_tokens=False)


def call(expr, name="calculator", key="expression"):
    return f'<tool_call>{json.dumps({"name": name, "arguments": {key: expr}})}</tool_call>'


def out(text, eos=True, finish=None, version=1):
    ids = enc(text) + ([EOS] if eos else [])
    return SampleOutput(ids, -0.5 * np.ones(len(ids)), [version] * len(ids), finish or ("stop" if eos else "length"))


def turns_script(*turns):
    """Turn k of every path answers with turns[k] (a text, or a callable(req) -> SampleOutput); k is read from
    the context (the number of assistant turns already in it)."""
    def script(req, _k):
        k = text_of(req.input_ids).count("<|assistant|>") - 1
        t = turns[min(k, len(turns) - 1)]
        return [t(req) if callable(t) else out(t) for _ in range(req.gconfig.n)]
    return script


def text_of(ids):
    return TOK.decode(list(ids), skip_special_tokens=False)


def agent(**kw):
    kw.setdefault("tools", ["calculator"])
    return ToolAgent(TOK, GCONF, **kw)


@pytest.mark.asyncio
async def test_chain_tool_call_then_answer_with_masked_observation():
    eng = FakeEngine(turns_script(call("12+7"), "19"))
    trajs = await eng.drive(agent(group_size=3), PROMPT)
    assert len(trajs) == 3 and len({t.group_id for t in trajs}) == 1
    # the first turn is one request with n=3 (shared prefill), then one request per chain
    assert [r.gconfig.n for r in eng.requests] == [3, 1, 1, 1]
    for t in trajs:
        assert t.reward == 1.0
        m = t.metadata
        assert (m["termination"], m["turns"], m["tool_calls"], m["tool_errors"], m["tool_calls_calculator"]) == (
            "answered", 2, 1, 0, 1)
        assert m["solved"] and m["void_turns"] == 0 and m["turn_kinds"] == "tool,answer"
        ledger = m["token_ledger"]
        assert [s for s, *_ in ledger] == ["prompt", "engine", "observation:calculator", "engine"]
        obs = ledger[2]
        assert text_of(t.input_ids[obs[1]:obs[2]]) == "<|user|><tool_response>19</tool_response><|assistant|>"
        assert t.loss_mask[obs[1]:obs[2]].sum() == 0 and (t.versions[obs[1]:obs[2]] == -1).all()
        for src, a, b in ledger:
            assert t.loss_mask[a:b].all() if src == "engine" else not t.loss_mask[a:b].any()
    # the second request of each chain is exactly the first context + the turn + the observation
    second = eng.requests[1]
    assert text_of(second.input_ids).endswith(call("12+7") + "<eos><|user|><tool_response>19</tool_response>"
                                              "<|assistant|>")


@pytest.mark.asyncio
async def test_malformed_unknown_and_bad_arguments_become_error_observations():
    bad_turns = [
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',  # invalid JSON
        call("1+1", name="nope"),  # unknown tool
        call("1+1", key="expr"),  # bad arguments
        call("1/0"),  # the tool raises
    ]
    for bad, expect in zip(bad_turns, ["malformed tool call", "unknown tool 'nope'", "bad arguments",
                                       "division by zero"]):
        eng = FakeEngine(turns_script(bad, "19"))
        (t,) = await eng.drive(agent(group_size=1), PROMPT)
        m = t.metadata
        assert m["termination"] == "answered" and m["tool_errors"] == 1 and m["tool_calls"] == 1, (bad, m)
        _, a, b = m["token_ledger"][2]
        assert expect in text_of(t.input_ids[a:b]), (expect, text_of(t.input_ids[a:b]))


@pytest.mark.asyncio
async def test_multiple_calls_in_one_turn_run_and_come_back_in_order():
    eng = FakeEngine(turns_script(call("2*3") + call("10-4"), "6"))
    (t,) = await eng.drive(agent(group_size=1), {**PROMPT, "answer": "6"})
    _, a, b = t.metadata["token_ledger"][2]
    assert text_of(t.input_ids[a:b]) == ("<|user|><tool_response>6</tool_response><|user|><tool_response>6"
                                         "</tool_response><|assistant|>")
    assert t.metadata["tool_calls"] == 2 and t.metadata["tool_calls_calculator"] == 2 and t.reward == 1.0


@pytest.mark.asyncio
async def test_budgets_each_have_their_own_termination_reason():
    # new tokens per turn: the turn is cut by max_new_tokens
    eng = FakeEngine(turns_script(lambda req: out("1" * req.gconfig.max_new_tokens, eos=False)))
    (t,) = await eng.drive(agent(group_size=1, max_new_tokens_per_turn=8), PROMPT)
    assert t.metadata["termination"] == "turn_budget" and eng.requests[0].gconfig.max_new_tokens == 8
    # total trajectory tokens: the second turn only gets what is left, and is cut by it
    prompt_len = len(agent().prompt_ids(PROMPT))
    eng = FakeEngine(turns_script(call("12+7"), lambda req: out("1" * req.gconfig.max_new_tokens, eos=False)))
    (t,) = await eng.drive(agent(group_size=1, max_total_tokens=prompt_len + 120), PROMPT)
    assert t.metadata["termination"] == "total_budget" and len(t.input_ids) == prompt_len + 120
    assert eng.requests[1].gconfig.max_new_tokens < 96
    # turns: the model keeps calling tools
    eng = FakeEngine(turns_script(call("1+1")))
    (t,) = await eng.drive(agent(group_size=1, max_turns=3), PROMPT)
    assert t.metadata["termination"] == "max_turns" and t.metadata["turns"] == 3 and t.metadata["tool_calls"] == 3
    # observation length: one long observation is truncated; the total observation budget ends the path
    eng = FakeEngine(turns_script(call("2**200"), "1"))
    (t,) = await eng.drive(agent(group_size=1, max_observation_tokens=40), PROMPT)
    _, a, b = t.metadata["token_ledger"][2]
    assert b - a <= 40 and t.metadata["obs_truncated"] == 1 and "..." in text_of(t.input_ids[a:b])
    eng = FakeEngine(turns_script(call("1+1")))
    (t,) = await eng.drive(agent(group_size=1, max_turns=10, max_total_observation_tokens=100), PROMPT)
    assert t.metadata["termination"] == "observation_budget" and t.metadata["obs_tokens"] <= 100
    # abort
    eng = FakeEngine(turns_script(lambda req: out("1", finish="abort")))
    (t,) = await eng.drive(agent(group_size=1), PROMPT)
    assert t.metadata["termination"] == "abort"


@pytest.mark.asyncio
async def test_void_turns():
    for text in ["", "<tool_call>{\"name\": \"calculator\""]:  # nothing, or EOS inside an unclosed call
        eng = FakeEngine(turns_script(text))
        (t,) = await eng.drive(agent(group_size=1, answer_regex=r"\d"), PROMPT)
        assert t.metadata["termination"] == "void_turn" and t.metadata["void_turns"] == 1 and t.reward == 0.0
    eng = FakeEngine(turns_script("no idea"))
    (t,) = await eng.drive(agent(group_size=1, answer_regex=r"\d"), PROMPT)
    assert t.metadata["termination"] == "void_turn"


@pytest.mark.asyncio
async def test_tree_rollout_branches_share_prefixes_within_the_node_budget():
    eng = FakeEngine(turns_script(call("12+7"), "19"))
    trajs = await eng.drive(agent(rollout="tree", tree_branching=2, tree_max_nodes=6), PROMPT)
    # root -> 2 tool-call nodes -> each branches 2 ways -> 4 answer leaves; 6 generated nodes in all
    assert len(trajs) == 4 and len({t.group_id for t in trajs}) == 1
    assert sorted(t.metadata["path"] for t in trajs) == ["0.0", "0.1", "1.0", "1.1"]
    assert [r.gconfig.n for r in eng.requests] == [2, 2, 2]
    by_path = {t.metadata["path"]: t for t in trajs}
    for a, b in [("0.0", "0.1"), ("1.0", "1.1")]:  # siblings share everything up to their last turn
        la = by_path[a].metadata["token_ledger"]
        cut = la[-1][1]
        assert (by_path[a].input_ids[:cut] == by_path[b].input_ids[:cut]).all()
    # the node budget stops branching: with 4 nodes the second level goes on one way each
    eng = FakeEngine(turns_script(call("12+7"), "19"))
    trajs = await eng.drive(agent(rollout="tree", tree_branching=2, tree_max_nodes=4), PROMPT)
    assert len(trajs) == 3 and [r.gconfig.n for r in eng.requests] == [2, 2, 1]


@pytest.mark.asyncio
async def test_chain_and_tree_group_sizes_differ_as_configured():
    eng = FakeEngine(turns_script("19"))
    chain = await eng.drive(agent(group_size=5), PROMPT)
    eng = FakeEngine(turns_script("19"))
    tree = await eng.drive(agent(rollout="tree", tree_branching=3, tree_max_nodes=9), PROMPT)
    assert len(chain) == 5 and len(tree) == 3  # answers at the first turn: the tree has only its root's children
    eng = FakeEngine(turns_script(call("12+7"), "19"))
    evaluation = await eng.drive(agent(group_size=1, rollout="tree", tree_branching=3, tree_max_nodes=9), PROMPT)
    assert len(evaluation) == 1 and [r.gconfig.n for r in eng.requests] == [1, 1]  # one greedy sample: a chain


def test_observation_encoder_keeps_text_after_the_end_of_turn_token():
    class Tok:
        eos_token = "<E>"

        def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False, **kw):
            s = "".join(f"[{m['role']}]{m['content']}<E>\n" for m in msgs)
            return s + ("[assistant]" if add_generation_prompt else "")

    assert ObservationEncoder(Tok()).text([{"role": "tool", "content": "42"}]) == "\n[tool]42<E>\n[assistant]"
