"""Trajectory traces: decoded turns with roles, generated vs context, rewards, versions and per-turn timings;
groups an agent returned nothing for rebuilt from their requests; the rollout worker's sampling; the writer."""

from __future__ import annotations

import asyncio
import itertools
import json

import numpy as np
import pytest

from arl.agents.math_multi_turn import MathMultiTurnAgent
from arl.agents.tool_agent import ToolAgent
from arl.api import GenerateResponse, GenerationConfig, SampleOutput
from arl.envs.math import MathEnv
from arl.models.tiny import TOOL_CHARS, build_char_tokenizer
from arl.report.traces import GroupTimeline, TraceSampler, TraceWriter, read_jsonl, request_traces, role_of, \
    trace_record
from arl.rollout.worker import run_agent
from arl.transport.codec import decode, encode
from tests.agents.test_tool_agent import call, turns_script
from tests.rollout.test_guards import run_groups
from tests.rollout.test_ledger import SeedAgent, make_worker

TOK = build_char_tokenizer(TOOL_CHARS)
EOS = TOK.eos_token_id
PROMPT = {"id": "p1", "prompt": "Tom has 12 apples and gets 7 more. How many?", "answer": "19"}


class InfoClient:
    """Answers from a script; says which worker answered (as InferenceClient does) and counts requests."""

    def __init__(self, script, worker: int = 1) -> None:
        self.script, self.worker, self.version = script, worker, 4
        self.stats, self._pending = {}, {}

    async def generate(self, req, info=None):
        await asyncio.sleep(0)
        if info is not None:
            info.update(worker=self.worker, attempts=1)
        return GenerateResponse(qid=req.qid, samples=self.script(req, 0))


def ticking_clock():
    """A clock that advances 1 s per reading: every request takes 1 s and every gap between them is 1 s."""
    c = itertools.count()
    return lambda: float(next(c))


def text(ids) -> str:
    return TOK.decode([int(i) for i in ids], skip_special_tokens=False)


def test_roles_of_ledger_sources() -> None:
    assert [role_of(s) for s in ("engine", "prompt", "observation:calculator", "feedback", "template")] == \
        ["assistant", "prompt", "tool", "user", "template"]


@pytest.mark.asyncio
async def test_tool_agent_trace_has_roles_generated_tokens_versions_and_turn_timings() -> None:
    timeline = GroupTimeline(clock=ticking_clock())
    agent = ToolAgent(TOK, GenerationConfig(max_new_tokens=96), group_size=1, tools=["calculator"])
    (traj,) = await run_agent(agent, PROMPT, MathEnv(), InfoClient(turns_script(call("12+7"), "19")), 10.0,
                              timeline=timeline)
    tr = trace_record(traj, TOK, timeline, step=4, outcome="accepted")
    assert tr["step"] == 4 and tr["outcome"] == "accepted" and tr["reward"] == 1.0
    assert tr["termination"] == "answered" and tr["prompt_id"] == "p1"
    assert [s["role"] for s in tr["segments"]] == ["prompt", "assistant", "tool", "assistant"]
    assert [s["gen"] for s in tr["segments"]] == [False, True, False, True]
    # the segments are the trajectory, decoded piece by piece, and the generated ones are the model's turns
    assert "".join(s["text"] for s in tr["segments"]) == text(traj.input_ids)
    gen = [s for s in tr["segments"] if s["gen"]]
    assert gen[0]["text"].startswith(call("12+7")) and gen[1]["text"].startswith("19")
    assert tr["segments"][2]["source"] == "observation:calculator" and "19" in tr["segments"][2]["text"]
    assert tr["n_generated"] == sum(s["n"] for s in gen) == traj.num_generated
    assert tr["versions"] == [1, 1] and gen[0]["v"] == [1, 1]
    # clock readings: t0=0, turn 0 sent 1 / back 2, turn 1 sent 3 / back 4
    t0, t1 = tr["turns"]
    assert (t0["t_sent"], t0["inference_s"], t0["env_tool_s"], t0["worker"], t0["finish"]) == (1, 1, 1, 1, "stop")
    assert (t1["t_sent"], t1["inference_s"], t1["env_tool_s"]) == (3, 1, None)
    assert t0["n"] == gen[0]["n"]
    assert "token_ledger" not in tr["metadata"] and tr["metadata"]["tool_calls"] == 1
    json.dumps(tr)  # plain JSON


@pytest.mark.asyncio
async def test_a_group_the_agent_filtered_is_rebuilt_from_its_requests() -> None:
    tok = build_char_tokenizer()
    eos = tok.eos_token_id

    def wrong(req, _k):  # every turn answers 5: wrong, so all chats fail and the agent drops the uniform group
        ids = tok.encode("5", add_special_tokens=False) + [eos]
        return [SampleOutput(ids, [-0.1] * len(ids), [2] * len(ids), "stop")]

    timeline = GroupTimeline(clock=ticking_clock())
    agent = MathMultiTurnAgent(tok, GenerationConfig(max_new_tokens=4), group_size=2, num_turns=2)
    trajs = await run_agent(agent, {"id": "12+7", "prompt": "12+7=", "answer": "19"}, MathEnv(),
                            InfoClient(wrong), 10.0, timeline=timeline)
    assert trajs == []  # filter_uniform_groups: the worker never sees these chats
    traces = request_traces(timeline, tok, step=2, outcome="filtered")
    assert len(traces) == 2  # one per chat (session)
    for tr in traces:
        assert tr["reconstructed"] and tr["reward"] is None and tr["outcome"] == "filtered"
        assert [s["gen"] for s in tr["segments"]] == [False, True, False, True]
        answer = tok.decode(tok.encode("5", add_special_tokens=False) + [eos], skip_special_tokens=False)
        assert [s["text"] for s in tr["segments"] if s["gen"]] == [answer, answer]
        assert "Wrong, try again." in tr["segments"][2]["text"]
        assert tr["versions"] == [2, 2] and tr["n_generated"] == 4
        assert [t["turn"] for t in tr["turns"]] == [0, 1]  # two chats interleave on the ticking clock
        assert tr["turns"][0]["inference_s"] > 0 and tr["turns"][0]["env_tool_s"] > 0


def test_sampler_is_seeded_and_forced_groups_always_pass() -> None:
    a, b = TraceSampler(0.3, seed=1), TraceSampler(0.3, seed=1)
    draws = [a.want(False) for _ in range(200)]
    assert draws == [b.want(False) for _ in range(200)]
    assert 30 < draws.count("sampled") < 90 and set(draws) == {"sampled", None}
    assert all(TraceSampler(0.0).want(True) == "forced" for _ in range(10))
    assert not any(TraceSampler(0.0).want(False) for _ in range(50))
    with pytest.raises(ValueError):
        TraceSampler(1.5)


class _InfoFake(InfoClient):
    def __init__(self) -> None:
        super().__init__(lambda req, k: [SampleOutput(np.array([5, 6, 7], np.int32), np.full(3, -0.5, np.float32),
                                                      np.full(3, 3, np.int32), "stop")] * req.gconfig.n, worker=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("rate", [0.0, 1.0])
async def test_worker_sends_sampled_and_forced_traces_with_group_done(rate: float) -> None:
    rows = [{"id": "mixed", "rewards": [1, 0, 0], "void": [0, 0, 1]},
            {"id": "uniform", "rewards": [1, 1, 1], "void": [0, 0, 0]}]
    sent, pushed = [], []
    worker = make_worker(rows, sent, pushed, SeedAgent, filter_void_turns=True, filter_uniform_groups=True,
                         tokenizer=TOK, trace_rate=rate)
    worker._client = _InfoFake()
    await run_groups(worker, 2)
    done = {p["reason"]: p for t, p in sent if t == "group_done"}
    assert set(done) == {"accepted", "filtered:uniform_reward"}
    # the void filter touched the accepted group and the uniform filter dropped the other: both traced at rate 0
    acc, uni = done["accepted"]["traces"], done["filtered:uniform_reward"]["traces"]
    assert [t["filtered"] for t in acc] == [None, None, "void_turns"]
    assert [t["reward"] for t in acc] == [1.0, 0.0, 0.0] and {t["why"] for t in acc} == {"forced"}
    assert [t["filtered"] for t in uni] == ["uniform_reward"] * 3 and uni[0]["outcome"] == "filtered:uniform_reward"
    assert acc[0]["step"] == 4 and acc[0]["rollout"] == 0 and acc[0]["group"].startswith("w0.")
    assert acc[0]["admission_s"] is None  # granted without an acquire (the test calls on_grant directly)
    assert acc[0]["turns"][0]["worker"] == 0 and acc[0]["segments"][1]["v"] == [3, 3]
    # the whole group_done, traces included, goes over the wire as it is
    msg_type, payload = decode(encode("group_done", done["accepted"]))
    assert payload["traces"] == acc
    await worker.close()


@pytest.mark.asyncio
async def test_worker_traces_clean_groups_only_when_sampled() -> None:
    rows = [{"id": "clean", "rewards": [1, 0, 1], "void": [0, 0, 0]}]
    for rate, expect in ((0.0, None), (1.0, "sampled")):
        sent, pushed = [], []
        worker = make_worker(rows, sent, pushed, SeedAgent, tokenizer=TOK, trace_rate=rate)
        worker._client = _InfoFake()
        await run_groups(worker, 1)
        (done,) = [p for t, p in sent if t == "group_done"]
        assert done["accepted"]
        assert (done.get("traces") or [{}])[0].get("why") == expect
        await worker.close()
    # without a tokenizer nothing is traced (and the client is called as before)
    sent, pushed = [], []
    worker = make_worker(rows, sent, pushed, SeedAgent, trace_rate=1.0)
    await run_groups(worker, 1)
    assert "traces" not in [p for t, p in sent if t == "group_done"][0]
    await worker.close()


def test_writer_appends_whole_lines_and_reader_skips_a_torn_one(tmp_path) -> None:
    path = str(tmp_path / "traces.jsonl")
    w = TraceWriter(path)
    w.write([])
    assert not (tmp_path / "traces.jsonl").exists()  # nothing traced, no file
    w.write([{"step": 1, "reward": 0.5}, {"step": 1, "reward": 0.0}])
    w.write([{"step": 2, "reward": 1.0}, "not a trace"])
    w.write("not a list")  # a malformed group_done from a peer
    w.close()
    with open(path, "a") as f:
        f.write('{"step": 3, "rew')  # a crash mid-line
    assert [t["step"] for t in read_jsonl(path)] == [1, 1, 2]
    assert [t["step"] for t in read_jsonl(path, last=1)] == [2]
    assert w.written == 3


def test_tail_jsonl_holds_only_the_newest_lines_and_counts_all(tmp_path):
    from arl.report.traces import tail_jsonl

    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        for i in range(1000):
            f.write(json.dumps({"i": i}) + "\n")
        f.write("\n{torn")  # a blank line is not counted, a torn last line is counted but not returned
    recs, n = tail_jsonl(str(path), 10)
    assert n == 1001 and [r["i"] for r in recs] == list(range(991, 1000))
    assert len(tail_jsonl(str(path), 0)[0]) == 1000 and tail_jsonl(str(tmp_path / "none"), 5) == ([], 0)
