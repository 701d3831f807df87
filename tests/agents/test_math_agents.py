"""Agents driven by a fake engine: a task reading obs_queue and answering on act_queue with scripted tokens."""

import asyncio

import numpy as np
import pytest

from arl.agents.common import QueueClient, generate
from arl.agents.math_multi_turn import MathMultiTurnAgent
from arl.agents.math_single_step import MathSingleStepAgent
from arl.api import AGENTS, GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput, make_agent, make_env
from arl.envs.math import MathEnv
from arl.models.tiny import build_char_tokenizer

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
PROMPT = {"id": "12+7", "prompt": "12+7=", "answer": "19"}
PROMPT_IDS = TOK.encode("<|user|>12+7=<|assistant|>", add_special_tokens=False)
FEEDBACK_IDS = TOK.encode("<|user|>Wrong, try again.<|assistant|>", add_special_tokens=False)


def ids(text, eos=True):
    return TOK.encode(text, add_special_tokens=False) + ([EOS] if eos else [])


def sample(token_ids, version=3, finish="stop", base=-0.1):
    n = len(token_ids)
    return SampleOutput(token_ids, base * (np.arange(n) + 1), [version] * n, finish)


class FakeEngine:
    """Answers each request with `script(req, k)` -> list[SampleOutput] (k: index of the request in its session).
    With `reorder=m`, holds up to m requests (or what arrived within 50 ms) and answers them in reverse order."""

    def __init__(self, script, reorder=0, error=None):
        self.script, self.reorder, self.error = script, reorder, error
        self.requests = []
        self.obs, self.act = asyncio.Queue(), asyncio.Queue()
        self.per_session = {}

    async def run(self):
        held = []
        while True:
            if held:  # more requests may follow; flush what is held once none arrives for a moment
                try:
                    req = await asyncio.wait_for(self.obs.get(), 0.05)
                except asyncio.TimeoutError:
                    await self._flush(held)
                    held = []
                    continue
            else:
                req = await self.obs.get()
            self.requests.append(req)
            k = self.per_session.get(req.session_id, 0)
            self.per_session[req.session_id] = k + 1
            if self.error:
                resp = GenerateResponse(qid=req.qid, error=self.error)
            else:
                resp = GenerateResponse(qid=req.qid, samples=self.script(req, k))
            held.append(resp)
            if len(held) >= max(1, self.reorder):
                await self._flush(held)
                held = []

    async def _flush(self, held):
        for r in reversed(held):
            await asyncio.sleep(0)
            await self.act.put(r)

    async def drive(self, agent, prompt=PROMPT, env=None):
        task = asyncio.create_task(self.run())
        env = env or MathEnv()
        try:
            return await asyncio.wait_for(agent.collect_trajectory(prompt, env, self.obs, self.act), 10)
        finally:
            task.cancel()


GCONF = GenerationConfig(max_new_tokens=4, temperature=1.0)


# --------------------------------------------------------------------------------------------- single step


@pytest.mark.asyncio
async def test_single_step_trajectories():
    outs = [ids("19"), ids("18"), ids("19"), ids("7", eos=False)]

    def script(req, k):
        return [sample(o, version=5 + i, finish="stop" if o[-1] == EOS else "length") for i, o in enumerate(outs)]

    eng = FakeEngine(script)
    agent = MathSingleStepAgent(TOK, GCONF, group_size=4)
    trajs = await eng.drive(agent)
    (req,) = eng.requests
    assert req.gconfig.n == 4 and EOS in req.gconfig.stop_token_ids and req.gconfig.max_new_tokens == 4
    assert req.input_ids.tolist() == PROMPT_IDS
    assert len(trajs) == 4 and len({t.group_id for t in trajs}) == 1 and trajs[0].group_id.startswith("12+7")
    for i, (t, o) in enumerate(zip(trajs, outs)):
        assert t.input_ids.tolist() == PROMPT_IDS + o
        assert t.loss_mask.tolist() == [0] * len(PROMPT_IDS) + [1] * len(o)
        np.testing.assert_allclose(t.logprobs[len(PROMPT_IDS):], -0.1 * (np.arange(len(o)) + 1), rtol=1e-6)
        assert (t.logprobs[: len(PROMPT_IDS)] == 0).all()
        assert t.versions.tolist() == [-1] * len(PROMPT_IDS) + [5 + i] * len(o)
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0, 0.0]
    assert [t.metadata["solved"] for t in trajs] == [True, False, True, False]
    meta = dict(trajs[0].metadata)
    assert meta.pop("token_ledger") == [["prompt", 0, len(PROMPT_IDS)], ["engine", len(PROMPT_IDS), len(trajs[0].input_ids)]]
    assert meta == {"turns": 1, "first_correct": True, "solved": True, "termination": "stop", "prompt_id": "12+7"}
    assert trajs[3].metadata["termination"] == "length" and trajs[0].turn_rewards == [1.0]


@pytest.mark.asyncio
async def test_single_step_uniform_filter_and_errors():
    script = lambda req, k: [sample(ids("19")) for _ in range(req.gconfig.n)]  # noqa: E731
    assert await FakeEngine(script).drive(MathSingleStepAgent(TOK, GCONF, group_size=3)) == []
    kept = await FakeEngine(script).drive(MathSingleStepAgent(TOK, GCONF, group_size=3, filter_uniform_groups=False))
    assert len(kept) == 3
    # evaluation: one greedy sample is never filtered
    one = await FakeEngine(script).drive(MathSingleStepAgent(TOK, GCONF.new(greedy=True), group_size=1))
    assert len(one) == 1 and one[0].reward == 1.0
    with pytest.raises(RuntimeError, match="engine overloaded"):
        await FakeEngine(script, error="engine overloaded").drive(MathSingleStepAgent(TOK, GCONF, group_size=2))


def test_registered():
    assert "math-single-step" in AGENTS and "math-multi-turn" in AGENTS
    agent = make_agent("math-multi-turn", tokenizer=TOK, gconfig=GCONF, group_size=2, num_turns=2)
    assert agent.feedback_ids == FEEDBACK_IDS
    with pytest.raises(ValueError):
        MathMultiTurnAgent(TOK, GCONF, group_size=0)


# ---------------------------------------------------------------------------------------------- multi turn

# chain index -> the answer of each turn
CHAINS = {0: ["19"], 1: ["18", "19"], 2: ["1", "2", "3"], 3: ["5", "5", "19"]}


def chain_script(req, k):
    chain = int(req.session_id.rsplit("/", 1)[1])
    return [sample(ids(CHAINS[chain][k]), version=10 * chain + k)]


@pytest.mark.asyncio
@pytest.mark.parametrize("reorder", [0, 4])
async def test_multi_turn(reorder):
    eng = FakeEngine(chain_script, reorder=reorder)
    agent = MathMultiTurnAgent(TOK, GCONF, group_size=4, num_turns=3)
    trajs = await eng.drive(agent)
    assert len(trajs) == 4
    # early stop on success: 1 + 2 + 3 + 3 requests, each n=1, one session per chain, unique qids
    assert len(eng.requests) == 9 and all(r.gconfig.n == 1 for r in eng.requests)
    assert len({r.qid for r in eng.requests}) == 9
    assert sorted(eng.per_session.values()) == [1, 2, 3, 3]
    assert [t.reward for t in trajs] == pytest.approx([1.0, 0.9, 0.0, 0.81])
    assert [t.turn_rewards for t in trajs] == [[1.0], [0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    assert all(t.turn_discount == 0.0 for t in trajs)  # each answer credited by its own turn's reward
    assert [t.metadata["termination"] for t in trajs] == ["solved", "solved", "max_turns", "solved"]
    assert [t.metadata["turns"] for t in trajs] == [1, 2, 3, 3]
    assert [t.metadata["first_correct"] for t in trajs] == [True, False, False, False]
    assert [t.metadata["solved"] for t in trajs] == [True, True, False, True]
    assert len({t.group_id for t in trajs}) == 1
    for c, t in enumerate(trajs):
        exp_ids, exp_mask, exp_ver = list(PROMPT_IDS), [0] * len(PROMPT_IDS), [-1] * len(PROMPT_IDS)
        for k, ans in enumerate(CHAINS[c]):
            if k:
                exp_ids += FEEDBACK_IDS
                exp_mask += [0] * len(FEEDBACK_IDS)
                exp_ver += [-1] * len(FEEDBACK_IDS)
            exp_ids += ids(ans)
            exp_mask += [1] * len(ids(ans))
            exp_ver += [10 * c + k] * len(ids(ans))
        assert t.input_ids.tolist() == exp_ids
        assert t.loss_mask.tolist() == exp_mask
        assert t.versions.tolist() == exp_ver
        assert (t.logprobs[t.loss_mask == 0] == 0).all() and (t.logprobs[t.loss_mask == 1] < 0).all()
    # every turn's request carried exactly the token history so far
    for req in eng.requests:
        chain = int(req.session_id.rsplit("/", 1)[1])
        assert trajs[chain].input_ids.tolist()[: len(req.input_ids)] == req.input_ids.tolist()
        assert int(req.input_ids[-1]) == TOK.convert_tokens_to_ids("<|assistant|>")


@pytest.mark.asyncio
async def test_multi_turn_greedy_single_chain_and_filters():
    always = lambda ans: (lambda req, k: [sample(ids(ans))])  # noqa: E731
    greedy = GCONF.new(greedy=True)
    (t,) = await FakeEngine(always("18")).drive(MathMultiTurnAgent(TOK, greedy, group_size=1))
    assert t.reward == 0.0 and t.metadata["turns"] == 2 and t.metadata["termination"] == "max_turns"  # the default
    assert await FakeEngine(always("19")).drive(MathMultiTurnAgent(TOK, GCONF, group_size=3)) == []
    assert len(await FakeEngine(always("19")).drive(
        MathMultiTurnAgent(TOK, GCONF, group_size=3, filter_uniform_groups=False))) == 3
    (shared,) = await FakeEngine(always("18")).drive(MathMultiTurnAgent(TOK, greedy, group_size=1,
                                                                       credit_per_turn=False))
    assert shared.turn_discount is None  # every token shares the chat's reward
    with pytest.raises(ValueError, match="credit_per_turn"):
        MathMultiTurnAgent(TOK, GCONF, credit_per_turn="no")


@pytest.mark.asyncio
async def test_multi_turn_length_and_abort():
    cut = lambda req, k: [sample(ids("12", eos=False), finish="length")]  # noqa: E731
    (t,) = await FakeEngine(cut).drive(MathMultiTurnAgent(TOK, GCONF, group_size=1))
    assert t.metadata["termination"] == "length" and t.metadata["turns"] == 1
    ab = lambda req, k: [sample(ids("1", eos=False), finish="abort")]  # noqa: E731
    (t,) = await FakeEngine(ab).drive(MathMultiTurnAgent(TOK, GCONF, group_size=1))
    assert t.metadata["termination"] == "abort"
    # no room for another turn under max_total_tokens
    wrong = lambda req, k: [sample(ids("18"))]  # noqa: E731
    agent = MathMultiTurnAgent(TOK, GCONF, group_size=1, max_total_tokens=len(PROMPT_IDS) + 3 + 10)
    (t,) = await FakeEngine(wrong).drive(agent)
    assert t.metadata["termination"] == "length" and t.metadata["turns"] == 1


@pytest.mark.asyncio
async def test_multi_turn_env_registry_and_reward_error():
    def script(req, k):
        return [sample(ids("19"))]

    env = MathEnv(reward_fn="tests.envs.test_math:bad_reward")
    (t,) = await FakeEngine(script).drive(MathMultiTurnAgent(TOK, GCONF, group_size=1, num_turns=2), env=env)
    assert t.reward == 0.0 and t.metadata["turns"] == 2 and "ZeroDivisionError" in t.metadata["reward_errors"][0]
    (t,) = await FakeEngine(script).drive(MathMultiTurnAgent(TOK, GCONF, group_size=1), env=make_env("math"))
    assert t.reward == 1.0


# ------------------------------------------------------------------------------------------- queue client


@pytest.mark.asyncio
async def test_queue_client_out_of_order_and_unknown_qid():
    obs, act = asyncio.Queue(), asyncio.Queue()
    reqs = [GenerateRequest(qid=f"q{i}", input_ids=[i]) for i in range(3)]
    tasks = [asyncio.create_task(generate(obs, act, r)) for r in reqs]
    got = [await obs.get() for _ in range(3)]
    assert sorted(r.qid for r in got) == ["q0", "q1", "q2"]
    await act.put(GenerateResponse(qid="stray", samples=[sample([1])]))
    for r in reversed(got):
        await act.put(GenerateResponse(qid=r.qid, samples=[sample([int(r.input_ids[0]) + 100])]))
    res = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert [int(x.samples[0].output_ids[0]) for x in res] == [100, 101, 102]
    # reader stops when nothing is pending; a later request works again
    t = asyncio.create_task(generate(obs, act, GenerateRequest(qid="late", input_ids=[1])))
    await obs.get()
    await act.put(GenerateResponse(qid="late", samples=[sample([7])]))
    assert (await asyncio.wait_for(t, 5)).qid == "late"
    client = QueueClient(obs, act)
    await client.close()


async def _echo_engine(obs: asyncio.Queue, act: asyncio.Queue) -> None:
    """Answers every request on `obs` with an empty response on `act`."""
    while True:
        req = await obs.get()
        await act.put(GenerateResponse(qid=req.qid))


@pytest.mark.asyncio
async def test_queue_client_new_request_right_after_reader_cancel():
    """Chain A finishes (its reader is cancelled) and chain B sends in the same tick: B must still be answered."""
    obs, act = asyncio.Queue(), asyncio.Queue()
    client = QueueClient(obs, act)

    eng = asyncio.create_task(_echo_engine(obs, act))
    for i in range(50):
        await client.generate(GenerateRequest(qid=f"a{i}", input_ids=[1]))
        # no await between A's finish (reader cancelled) and B's send
        async with asyncio.timeout(2.0):  # (wait_for would run it in a new task, hiding the race)
            resp = await client.generate(GenerateRequest(qid=f"b{i}", input_ids=[1]))
        assert resp.qid == f"b{i}"
    eng.cancel()


@pytest.mark.asyncio
async def test_queue_client_keeps_its_reader_between_back_to_back_requests_and_stops_it_when_idle():
    obs, act = asyncio.Queue(), asyncio.Queue()
    client = QueueClient(obs, act)

    eng = asyncio.create_task(_echo_engine(obs, act))
    try:
        await client.generate(GenerateRequest(qid="a", input_ids=[1]))
        reader = client._reader
        await client.generate(GenerateRequest(qid="b", input_ids=[1]))  # sent in the same iteration: same reader
        assert client._reader is reader and reader is not None
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert client._reader is None and reader.cancelled()  # idle for an iteration: stopped
    finally:
        eng.cancel()


@pytest.mark.asyncio
async def test_queue_client_takes_the_direct_path_when_the_obs_queue_offers_one():
    class DirectQueue(asyncio.Queue):
        async def generate(self, req):
            return GenerateResponse(qid=req.qid, samples=[sample([42])])

    obs, act = DirectQueue(), asyncio.Queue()
    resp = await QueueClient(obs, act).generate(GenerateRequest(qid="d", input_ids=[1]))
    assert resp.samples[0].output_ids.tolist() == [42] and obs.empty() and act.empty()
