"""Token ledger check (engine tokens + declared insertions, nothing else), and the rollout worker's use of it,
of the trajectory filters and of env groups."""

from __future__ import annotations

import asyncio
import collections

import pytest

from arl.agents.tool_agent import ToolAgent
from arl.api import Agent, EnvironmentService, GenerateRequest, GenerateResponse, GenerationConfig, TrajectoryBuilder
from arl.models.tiny import TOOL_CHARS, build_char_tokenizer
from arl.rollout.env_groups import worker_spec
from arl.rollout.ledger import EngineLog, TokenLedgerError, verify_trajectory
from arl.rollout.worker import PromptStream, RolloutWorker, run_agent
from tests.agents.test_tool_agent import call, turns_script
from tests.rollout.test_guards import FakeClient, run_groups
from tests.typed_control import typed

TOK = build_char_tokenizer(TOOL_CHARS)
PROMPT = {"id": "p1", "prompt": "Tom has 12 apples and gets 7 more. How many?", "answer": "19"}


class ScriptClient:
    """An inference client answering from a `turns_script`."""

    def __init__(self, script):
        self.script, self.stats, self._pending = script, collections.Counter(), {}

    async def generate(self, req):
        await asyncio.sleep(0)
        return GenerateResponse(qid=req.qid, samples=self.script(req, 0))


async def tool_trajs(**kw):
    from arl.envs.math import MathEnv

    log = EngineLog()
    agent = ToolAgent(TOK, GenerationConfig(max_new_tokens=96), tools=["calculator"], **kw)
    trajs = await run_agent(agent, PROMPT, MathEnv(), ScriptClient(turns_script(call("12+7"), "19")), 10.0, log)
    return trajs, log


@pytest.mark.asyncio
async def test_honest_trajectories_pass_chain_and_tree():
    for kw in [{"group_size": 3}, {"rollout": "tree", "tree_branching": 2, "tree_max_nodes": 6}]:
        trajs, log = await tool_trajs(**kw)
        for t in trajs:
            counts = verify_trajectory(t, log)
            assert set(counts) == {"prompt", "engine", "observation"} and sum(counts.values()) == len(t.input_ids)


@pytest.mark.asyncio
async def test_drift_fails_loudly():
    trajs, log = await tool_trajs(group_size=1)
    t = trajs[0]
    led = t.metadata["token_ledger"]
    eng = [e for e in led if e[0] == "engine"]

    def tampered(fn):
        c = type(t)(t.input_ids.copy(), t.loss_mask.copy(), t.logprobs.copy(), t.versions.copy(), t.reward,
                    t.group_id, list(t.turn_rewards), {**t.metadata, "token_ledger": [list(e) for e in led]})
        fn(c)
        return c

    def retokenised(c):  # a generated token replaced (what decode + encode of a turn can do)
        c.input_ids[eng[0][1] + 2] += 1

    def prompt_edited(c):  # the context the engine saw is not the one the learner gets
        c.input_ids[1] += 1

    def logprob(c):
        c.logprobs[eng[1][1]] -= 0.25

    def version(c):
        c.versions[eng[1][1]] += 1

    def trained_on_observation(c):
        obs = [e for e in led if e[0].startswith("observation")][0]
        c.loss_mask[obs[1]] = 1

    def gap(c):
        c.metadata["token_ledger"][2][2] -= 1  # an observation one token shorter: a gap

    def no_ledger(c):
        del c.metadata["token_ledger"]

    for fn, msg in [(retokenised, "no sample the engine returned"), (prompt_edited, "different context"),
                    (logprob, "logprobs differ"), (version, "versions differ"), (trained_on_observation, "loss_mask 1"),
                    (gap, "does not continue"), (no_ledger, "no 'token_ledger'")]:
        with pytest.raises(TokenLedgerError, match=msg):
            verify_trajectory(tampered(fn), log)
    verify_trajectory(t, log)


class RetokenisingAgent(Agent):
    """Decodes the engine's tokens and adds them back as if generated: the bug the check exists for."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        await obs_queue.put(GenerateRequest(qid="q", input_ids=[1, 2, 3], gconfig=GenerationConfig(n=2)))
        resp = await act_queue.get()
        out = []
        for s in resp.samples:
            b = TrajectoryBuilder([1, 2, 3])
            fake = type(s)(s.output_ids[::-1].copy(), s.output_logprobs, s.output_versions, s.finish_reason)
            b.add_generated(fake)
            out.append(b.build(reward=1.0, group_id="g"))
        return out


class SeedEnv(EnvironmentService):
    async def reset(self, seed=None, options=None):
        self.seed = seed
        return None, {}

    async def step(self, action):
        return None, 0.0, True, False, {}


class SeedAgent(Agent):
    """Reports each member env's seed (one env instance per trajectory) and rewards by the prompt."""

    def __init__(self, void=False):
        self.void = void

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        from arl.agents.common import env_for

        await obs_queue.put(GenerateRequest(qid="q", input_ids=[1, 2], gconfig=GenerationConfig(n=3)))
        resp = await act_queue.get()
        out = []
        for i, s in enumerate(resp.samples):
            e = await env_for(env, i)
            b = TrajectoryBuilder([1, 2])
            b.add_generated(s)
            out.append(b.build(reward=float(prompt["rewards"][i]), group_id="g",
                               metadata={"env_id": id(e), "seed": e.wrapped.seed, "void_turns": prompt["void"][i],
                                         "tool_calls": i}))
        return out


def make_worker(rows, sent, pushed, agent, **kw):
    async def send(msg_type, payload):
        sent.append((msg_type, payload))

    async def push(group):
        pushed.append(group)

    return RolloutWorker(index=0, make_agent=agent, make_eval_agent=agent, make_env=SeedEnv,
                         prompts=PromptStream(rows, seed=0), test_rows=rows, client=FakeClient(), send_control=typed(send),
                         push_group=push, capacity=8, trajectory_timeout=5.0, env_timeout=1.0, **kw)


@pytest.mark.asyncio
async def test_worker_reports_ledger_drift_as_a_fatal_error():
    sent, pushed = [], []
    worker = make_worker([{"id": "a"}], sent, pushed, RetokenisingAgent, verify_token_ledger=True)
    await run_groups(worker, 1)
    assert pushed == [] and any(t == "error" and "token ledger" in p["message"] for t, p in sent)
    assert [p["reason"] for t, p in sent if t == "group_done"] == ["error:TokenLedgerError"]
    # the same agent without the check goes through (which is why the e2e tests turn it on)
    sent, pushed = [], []
    await run_groups(make_worker([{"id": "a"}], sent, pushed, RetokenisingAgent), 1)
    assert len(pushed) == 1


@pytest.mark.asyncio
async def test_worker_filters_count_reasons_and_env_groups_share_seeds():
    rows = [{"id": "mixed", "rewards": [1, 0, 0], "void": [0, 0, 1]},
            {"id": "uniform", "rewards": [1, 1, 1], "void": [0, 0, 0]},
            {"id": "allvoid", "rewards": [1, 0, 1], "void": [1, 1, 1]}]
    spec = worker_spec(make_env=lambda name, **kw: SeedEnv(), env_name="seed", env_args={}, group_size=3,
                       num_env_groups=4, num_workers=2, worker=1)
    assert spec.group_indices == [1, 3]
    sent, pushed = [], []
    worker = make_worker(rows, sent, pushed, SeedAgent, env_groups=spec, filter_void_turns=True,
                         filter_uniform_groups=True, verify_token_ledger=True)
    assert worker._capacity == 2  # two env groups on this worker
    await run_groups(worker, 3)
    done = {p["reason"]: p for t, p in sent if t == "group_done"}
    assert set(done) == {"accepted", "filtered:uniform_reward", "filtered:void_turns"}
    (group,) = pushed
    assert len(group) == 2 and [t.reward for t in group] == [1.0, 0.0]
    assert done["accepted"]["traj_stats"]["void_trajectories_dropped"] == 1
    assert done["accepted"]["traj_stats"]["tool_calls"] == 3 and done["accepted"]["n_traj_raw"] == 3
    assert worker.stats["void_trajectories_dropped"] == 4 and worker.stats["ledger_checked"] == 9
    assert worker.drop_reasons == {"filtered:uniform_reward": 1, "filtered:void_turns": 1}
    # one env instance per trajectory, one seed per group
    assert len({t.metadata["env_id"] for t in group}) == 2 and len({t.metadata["seed"] for t in group}) == 1
    hb = worker.heartbeat_stats()
    assert hb["traj_stats"]["reward"] == 6.0
    await worker.close()
