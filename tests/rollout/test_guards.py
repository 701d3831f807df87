"""Isolation: env calls and agents have deadlines; a hung or raising env drops its group with a counted reason and
returns the budget (group_done accepted=False), and the worker goes on."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

from arl.api import Agent, EnvironmentService, GenerateResponse, SampleOutput, TrajectoryBuilder
from arl.rollout.guards import DeadlineExceeded, EnvCallError, GuardedEnv, call_with_deadline
from arl.rollout.worker import PromptStream, RolloutWorker, run_agent

from ..typed_control import typed


class FakeClient:
    """Answers every request with one 3-token sample per n."""

    def __init__(self) -> None:
        self.stats: collections.Counter = collections.Counter()
        self._pending: dict = {}

    async def generate(self, req):
        self.stats["sent"] += 1
        await asyncio.sleep(0)
        s = SampleOutput(np.array([5, 6, 7], np.int32), np.full(3, -0.5, np.float32), np.zeros(3, np.int32), "stop")
        return GenerateResponse(qid=req.qid, samples=[s] * req.gconfig.n)


class ScriptedEnv(EnvironmentService):
    """step() behaves per prompt: 'ok' -> reward, 'hang' -> sleeps forever, 'raise' -> ValueError,
    'stubborn' -> sleeps and swallows cancellation, 'nan' -> NaN reward."""

    def __init__(self) -> None:
        self.mode = "ok"

    async def reset(self, seed=None, options=None):
        self.mode = (options or {}).get("mode", self.mode)
        if self.mode == "hang_reset":
            await asyncio.sleep(3600)
        return None, {}

    async def step(self, action):
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "stubborn":
            for _ in range(3):
                try:
                    await asyncio.sleep(0.5)
                except asyncio.CancelledError:
                    pass
        if self.mode == "raise":
            raise ValueError("env exploded")
        if self.mode == "nan":
            return None, float("nan"), True, False, {}
        if self.mode == "reward_timeout":
            return None, 0.0, True, False, {"error": "reward timed out after 1s"}
        return None, 1.0 if action == [5, 6, 7] else 0.5, True, False, {}


class OneShotAgent(Agent):
    """Asks for `group_size` samples and rewards each through env.step; optionally swallows env errors."""

    def __init__(self, group_size: int = 2, swallow: bool = False) -> None:
        from arl.api import GenerationConfig

        self.g = GenerationConfig(n=group_size, max_new_tokens=3)
        self.swallow = swallow

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        await obs_queue.put((prompt["id"], [1, 2, 3], self.g))
        resp = await act_queue.get()
        out = []
        for s in resp.samples:
            try:
                _, r, *_ = await env.step(s.output_ids.tolist())
            except EnvCallError:
                if not self.swallow:
                    raise
                r = 0.0
            b = TrajectoryBuilder([1, 2, 3])
            b.add_generated(s)
            out.append(b.build(reward=float(r), group_id=prompt["id"]))
        return out


class StubbornAgent(Agent):
    """Ignores its first cancellation (asyncio.wait_for would wait on it for an hour); gives in to the second (the
    test loop's final cancel-all) so the loop can close."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(3600)


# -- GuardedEnv / call_with_deadline -------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_guard_times_out_hung_step_and_counts():
    stats = collections.Counter()
    env = GuardedEnv(ScriptedEnv(), timeout=0.05, stats=stats)
    await env.reset(options={"mode": "hang"})
    with pytest.raises(EnvCallError) as ei:
        await env.step([1])
    assert ei.value.reason == "env_timeout:step" and env.failure == "env_timeout:step"
    assert stats["env_timeout"] == 1 and stats["env_calls_in_flight"] == 0


@pytest.mark.asyncio
async def test_guard_wraps_errors_and_bad_results():
    env = GuardedEnv(ScriptedEnv(), timeout=1.0)
    await env.reset(options={"mode": "raise"})
    with pytest.raises(EnvCallError) as ei:
        await env.step([1])
    assert ei.value.reason == "env_error:step:ValueError" and "env exploded" in str(ei.value)
    env = GuardedEnv(ScriptedEnv(), timeout=1.0)
    await env.reset(options={"mode": "nan"})
    with pytest.raises(EnvCallError, match="non-finite"):
        await env.step([1])
    assert env.failure == "env_error:step:BadReward"


@pytest.mark.asyncio
async def test_guard_does_not_wait_for_a_coroutine_that_swallows_cancellation():
    env = GuardedEnv(ScriptedEnv(), timeout=0.05)
    await env.reset(options={"mode": "stubborn"})
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(EnvCallError):
        await env.step([1])
    assert loop.time() - t0 < 1.0  # the stubborn step would take 1.5 s; not a wall-clock threshold on work done
    with pytest.raises(DeadlineExceeded):
        await call_with_deadline(StubbornAgent().collect_trajectory({}, None, None, None), 0.05)


@pytest.mark.asyncio
async def test_guard_passes_attributes_and_counts_reward_timeouts():
    inner = ScriptedEnv()
    stats = collections.Counter()
    env = GuardedEnv(inner, timeout=1.0, stats=stats)
    assert env.mode == "ok" and env.wrapped is inner
    await env.reset(options={"mode": "reward_timeout"})
    out = await env.step([1])
    assert out[1] == 0.0 and stats["reward_timeout"] == 1 and env.failure is None


# -- run_agent / RolloutWorker -------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_run_agent_deadline_with_stubborn_agent():
    with pytest.raises(asyncio.TimeoutError):
        await run_agent(StubbornAgent(), {"id": "p"}, ScriptedEnv(), FakeClient(), timeout=0.05)


def make_worker(rows, sent, pushed, agent_factory=OneShotAgent, env_timeout=0.1, capacity=4):
    async def send(msg_type, payload):
        sent.append((msg_type, payload))

    async def push(group):
        pushed.append(group)

    return RolloutWorker(
        index=0,
        make_agent=agent_factory,
        make_eval_agent=agent_factory,
        make_env=ScriptedEnv,
        prompts=PromptStream(rows, seed=0),
        test_rows=rows,
        client=FakeClient(),
        send_control=typed(send),
        push_group=push,
        capacity=capacity,
        trajectory_timeout=5.0,
        env_timeout=env_timeout,
    )


async def run_groups(worker, n):
    worker.on_grant(n)
    for _ in range(500):
        if not worker._running:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("groups did not finish")


@pytest.mark.asyncio
async def test_worker_drops_hung_and_raising_env_groups_and_goes_on():
    rows = [{"id": "ok1", "mode": "ok"}, {"id": "hang", "mode": "hang"}, {"id": "raise", "mode": "raise"},
            {"id": "ok2", "mode": "ok"}, {"id": "hr", "mode": "hang_reset"}]
    sent, pushed = [], []
    worker = make_worker(rows, sent, pushed)
    await run_groups(worker, 5)
    done = [p for t, p in sent if t == "group_done"]
    assert len(done) == 5  # every admitted group reports back: its budget is returned either way
    reasons = collections.Counter(p["reason"] for p in done)
    assert reasons == {"accepted": 2, "env_timeout:step": 1, "env_error:step:ValueError": 1,
                       "env_timeout:reset": 1}
    assert all(p["accepted"] == (p["reason"] == "accepted") for p in done)
    assert len(pushed) == 2 and all(len(g) == 2 for g in pushed)
    assert worker.drop_reasons == {"env_timeout:step": 1, "env_error:step:ValueError": 1, "env_timeout:reset": 1}
    hb = worker.heartbeat_stats()
    assert hb["env"]["env_timeout"] == 2 and hb["env"]["env_error"] == 1 and hb["env"]["env_calls_in_flight"] == 0
    assert "groups running" in hb["waiting_on"]
    # the worker goes on: more groups after the failures
    await run_groups(worker, 2)
    assert len([p for t, p in sent if t == "group_done"]) == 7


@pytest.mark.asyncio
async def test_worker_drops_group_whose_agent_swallowed_the_env_failure():
    rows = [{"id": "raise", "mode": "raise"}]
    sent, pushed = [], []
    worker = make_worker(rows, sent, pushed, agent_factory=lambda: OneShotAgent(swallow=True))
    await run_groups(worker, 1)
    (p,) = [p for t, p in sent if t == "group_done"]
    assert p == {**p, "accepted": False, "reason": "env_error:step:ValueError"} and pushed == []


@pytest.mark.asyncio
async def test_group_ids_unique_across_worker_restarts():
    rows = [{"id": "same", "mode": "ok"}]
    ids = []
    for _ in range(2):  # two incarnations of worker 0 (a restart)
        sent, pushed = [], []
        worker = make_worker(rows, sent, pushed)
        await run_groups(worker, 1)
        ids.append(pushed[0][0].group_id)
    assert ids[0] != ids[1] and all(i.endswith(":same") for i in ids)


@pytest.mark.asyncio
async def test_row_with_missing_fields_is_dropped_and_counted():
    """A data row the agent cannot use (here: no prompt) fails only its own group, with a named reason."""
    from arl.agents.common import row_messages

    class ChatAgent(OneShotAgent):
        async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
            row_messages(prompt)
            return await super().collect_trajectory(prompt, env, obs_queue, act_queue)

    rows = [{"id": "no-prompt", "answer": "1"}]
    sent, pushed = [], []
    worker = make_worker(rows, sent, pushed, agent_factory=ChatAgent)
    await run_groups(worker, 1)
    (p,) = [p for t, p in sent if t == "group_done"]
    assert p["reason"] == "error:ValueError" and not p["accepted"]


def test_empty_training_set_is_a_clear_error():
    with pytest.raises(ValueError, match="empty"):
        PromptStream([], seed=0)


@pytest.mark.asyncio
async def test_a_dropped_group_says_its_error_and_where_it_was_raised():
    """group_done carries the error's own message and the innermost frames of its traceback (bounded), whether
    the env's exception reached the worker, the agent swallowed it, or the agent itself raised; a timeout says so."""

    class RaisingAgent(OneShotAgent):
        async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
            raise KeyError("answer" * 300)

    details = {}
    for name, factory, mode in (("env", OneShotAgent, "raise"), ("swallowed", lambda: OneShotAgent(swallow=True),
                                "raise"), ("agent", RaisingAgent, "ok"), ("hang", OneShotAgent, "hang"),
                                ("ok", OneShotAgent, "ok")):
        sent, pushed = [], []
        worker = make_worker([{"id": name, "mode": mode}], sent, pushed, agent_factory=factory)
        await run_groups(worker, 1)
        (p,) = [p for t, p in sent if t == "group_done"]
        details[name] = p.get("error")
    for name in ("env", "swallowed"):
        first, *frames = details[name].splitlines()
        assert first == "ScriptedEnv.step raised ValueError: env exploded"
        assert 'raise ValueError("env exploded")' in frames[-1] and "in step" in frames[-2]
    assert details["agent"].startswith("KeyError: 'answeranswer") and len(details["agent"]) <= 1500
    assert "in collect_trajectory" in details["agent"]
    assert details["hang"] == "ScriptedEnv.step took longer than 0.1s"
    assert details["ok"] is None  # an accepted group carries none
