"""Proposer and solver in one policy (registered as agent "proposer-solver"): the policy writes a+b problems for
itself and is rewarded, as the proposer, for problems it solves about half the time (a curriculum at the edge of
its ability) and, as the solver, for right answers. One set of weights plays both roles, told apart by the prompt,
as in Absolute Zero (Zhao et al., 2025).

A training group (one dataset row: its text is not used, the proposer writes the problems):

1. **Propose.** `group_size` samples of the prompt `propose a+`, `a` the first operand of the group's dataset row
   (`<|user|>propose 12+<|assistant|>30=<eos>`): the row anchors the problem, the proposer picks the second
   operand, so it steers difficulty without narrowing the task to a few problems (with a bare `propose`, the
   proposals collapsed onto ~10 problems like `45+45` within 150 steps and the solver's held-out accuracy fell
   back from its best). A proposal is valid when it states a number `b` in 0..`max_operand`, `a+b` is not one of
   the run's held-out rows (`held_out`: the rollout worker passes them to an agent that asks), so the evaluation
   stays unseen, and no earlier proposal of the group wrote the same problem.
2. **Solve.** Each valid problem goes to the solver `solver_attempts` times (`<|user|>12+30=<|assistant|>`, the
   dataset's own format); the env (`math`, reset with the problem's answer) scores each answer.
3. **Rewards.** A solver answer: the env's reward (1 right, 0 wrong). A proposal: `1 - |2 p - 1|`, p the solver's
   success rate on it (1 at p = 1/2, 0 for problems always or never solved), 0 if invalid or a repeat. The proposer's samples
   form one advantage group, each problem's answers another (`group_id`s `<gid>/propose`, `<gid>/solve<i>`); a
   sub-group whose rewards are all equal carries no signal and is left out (`filter_uniform_groups`).

Evaluation (a group of one): the solver alone, greedy, on the held-out row's problem, so the run's held-out
accuracy is the solver's.

`proposer=NAME`: the proposals come from policy NAME instead (a trainable listed policy, `policies: [{name:
proposer, adapter: base, trainable: true}]`, with a learner of its own), recorded under it: two policies, each
trained on its own role by its own learner (docs/multi_policy.md).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Optional, Sequence

from arl.agents.common import agent_gconfig, check_int, encode_chat, env_for, filter_uniform, gather_or_cancel, \
    generate, new_id, start_prompt
from arl.api import Agent, EnvironmentService, GenerateRequest, GenerationConfig, Trajectory, TrajectoryBuilder, \
    register_agent, scalar_reward

_OPERAND_RE = re.compile(r"^\s*(\d{1,3})=?\s*$")


def propose_prompt(a: int) -> str:
    return f"propose {a}+"


def anchor_of(row: dict[str, Any], max_operand: int) -> int:
    """The first operand a group's proposals start from: the row's (an a+b row), else from its id's hash."""
    m = re.match(r"\s*(\d+)\+", str(row.get("prompt", "")))
    return int(m.group(1)) if m is not None and int(m.group(1)) <= max_operand else \
        sum(map(ord, str(row.get("id", "")))) % (max_operand + 1)


def parse_operand(text: str, max_operand: int) -> Optional[int]:
    """The second operand of a proposal that is exactly `b` or `b=` with b in 0..max_operand, else None."""
    m = _OPERAND_RE.match(text)
    if m is None or int(m.group(1)) > max_operand:
        return None
    return int(m.group(1))


def proposer_reward(solve_rate: float) -> float:
    """Highest for a problem solved half the time; 0 for one always or never solved."""
    return 1.0 - abs(2.0 * solve_rate - 1.0)


class ProposerSolverAgent(Agent):
    def __init__(self, tokenizer: Any, gconfig: GenerationConfig, group_size: int = 8, solver_attempts: int = 4,
                 max_operand: int = 49, held_out: Sequence[dict[str, Any]] = (),
                 filter_uniform_groups: bool = True, proposer: Optional[str] = None) -> None:
        check_int("group_size", group_size)
        if proposer is not None and (not isinstance(proposer, str) or not proposer):
            raise ValueError(f"proposer-solver: proposer must be a policy's name or unset, got {proposer!r}")
        self.proposer = proposer
        check_int("solver_attempts", solver_attempts)
        if solver_attempts < 2:
            raise ValueError(f"proposer-solver: solver_attempts must be >= 2 (a success rate), got {solver_attempts}")
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.solver_attempts = solver_attempts
        self.max_operand = max_operand
        # a row's problem as "a+b" (arith rows: their id; other rows: their prompt without "=")
        self.held_out = {str(r.get("prompt", r.get("id", ""))).rstrip("=").replace(" ", "") for r in held_out}
        self.filter_uniform_groups = filter_uniform_groups
        self.propose_gconfig = agent_gconfig(gconfig, tokenizer, n=group_size)
        self.solve_gconfig = agent_gconfig(gconfig, tokenizer, n=solver_attempts)
        self.eval_gconfig = agent_gconfig(gconfig, tokenizer, n=1)

    def _decode(self, sample: Any) -> str:
        return self.tokenizer.decode(sample.output_ids.tolist(), skip_special_tokens=True)

    async def _solve(self, i: int, problem: tuple[int, int], gid: str, env: EnvironmentService,
                     obs_queue: asyncio.Queue, act_queue: asyncio.Queue) -> list[Trajectory]:
        a, b = problem
        prompt_ids = encode_chat(self.tokenizer, [{"role": "user", "content": f"{a}+{b}="}])
        resp = await generate(obs_queue, act_queue, GenerateRequest(qid=new_id(f"{gid}/solve{i}"),
                                                                    input_ids=prompt_ids, gconfig=self.solve_gconfig))
        trajs = []
        for j, sample in enumerate(resp.samples):
            e = await env_for(env, i * self.solver_attempts + j)
            await e.reset(options={"answer": str(a + b)})
            trajs.append(await self._answer(e, prompt_ids, sample, f"{gid}/solve{i}", f"{a}+{b}"))
        return trajs

    async def _answer(self, env: EnvironmentService, prompt_ids: list[int], sample: Any, group_id: str,
                      prompt_id: str) -> Trajectory:
        """One solver answer, scored by `env` (reset with its problem's answer), as a trajectory."""
        _, reward, _, _, info = await env.step(self._decode(sample))
        correct = bool(info.get("correct", False))
        tb = TrajectoryBuilder(prompt_ids)
        tb.add_generated(sample)
        return tb.build(reward=scalar_reward(reward), group_id=group_id,
                        metadata={"role": "solver", "turns": 1, "first_correct": correct, "solved": correct,
                                  "termination": sample.finish_reason, "prompt_id": prompt_id})

    async def collect_trajectory(self, prompt: dict[str, Any], env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        if self.group_size == 1:  # evaluation: the solver on the row's problem
            pid, gid, prompt_ids = await start_prompt(self.tokenizer, prompt, env)
            req = GenerateRequest(qid=new_id(pid), input_ids=prompt_ids, gconfig=self.eval_gconfig)
            sample = (await generate(obs_queue, act_queue, req)).samples[0]
            return [await self._answer(env, prompt_ids, sample, gid, pid)]
        gid = new_id(str(prompt.get("id", "propose")))
        a = anchor_of(prompt, self.max_operand)
        propose_ids = encode_chat(self.tokenizer, [{"role": "user", "content": propose_prompt(a)}])
        resp = await generate(obs_queue, act_queue, GenerateRequest(qid=new_id(f"{gid}/propose"),
                                                                    input_ids=propose_ids,
                                                                    gconfig=self.propose_gconfig,
                                                                    policy=self.proposer))
        problems: list[Optional[tuple[int, int]]] = []
        why: list[str] = []
        for sample in resp.samples:
            b = parse_operand(self._decode(sample), self.max_operand)
            reason = ("invalid" if b is None else "held_out" if f"{a}+{b}" in self.held_out
                      else "repeat" if (a, b) in problems else "")
            problems.append((a, b) if not reason else None)  # type: ignore[arg-type]
            why.append(reason)
        valid = [(i, p) for i, p in enumerate(problems) if p is not None]
        solved = await gather_or_cancel(self._solve(i, p, gid, env, obs_queue, act_queue) for i, p in valid)
        rates = {i: sum(t.reward for t in ts) / len(ts) for (i, _), ts in zip(valid, solved)}
        proposals = []
        for i, (sample, p) in enumerate(zip(resp.samples, problems)):
            tb = TrajectoryBuilder(propose_ids)
            tb.add_generated(sample, policy=self.proposer)
            rate = rates.get(i)
            proposals.append(tb.build(
                reward=proposer_reward(rate) if rate is not None else 0.0, group_id=f"{gid}/propose",
                metadata={"role": "proposer", "turns": 1, "valid": p is not None, "termination": sample.finish_reason,
                          "prompt_id": str(prompt.get("id", "")), **({why[i]: True} if why[i] else {}),
                          **({"solve_rate": rate} if rate is not None else {})}))
        out = filter_uniform(proposals, self.filter_uniform_groups)
        for ts in solved:
            out.extend(filter_uniform(ts, self.filter_uniform_groups))
        return out


register_agent("proposer-solver", ProposerSolverAgent)
