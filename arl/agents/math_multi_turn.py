"""Multi-turn math agent: `group_size` independent chats per prompt, each retrying after a wrong answer.

Turn t of a chat sends the whole token history (n=1). A wrong answer is followed by a feedback user message
rendered with the chat template (with the generation prompt) and tokenised once in __init__; it is appended as
context (loss_mask 0). Generated tokens, including the eos they end with, stay exactly as the engine returned
them: the history is never decoded and re-encoded.

reward = turn_discount ** t if the chat is solved at turn t (0-based; 1.0 for a first-turn success), else 0.0.
Credit (`credit_per_turn`, default): each answer is judged on its own, so each turn's tokens are credited by that
turn's reward alone (`Trajectory.turn_discount = 0`): a wrong answer is not reinforced by the retry that fixed it,
which matters because the evaluation scores first answers. `credit_per_turn=False`: every token shares `reward`.
termination: "solved" | "max_turns" | "length" (a wrong answer cut by max_new_tokens, or no room left under
`max_total_tokens`) | "abort" (the engine aborted the request).

Two answers a chat by default (`num_turns`): on the default run a third cost a quarter of the training time (its
context is the longest, prefilled again after each weight update, and its group waits on it) and added no
first-answer accuracy; the time bought 150 more steps (docs/benchmarks.md, "Two answers a chain, 500 steps").
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from arl.agents.common import (agent_gconfig, check_int, encode_chat, env_for, filter_uniform, gather_or_cancel,
                               generate, new_id, start_prompt)
from arl.api import (Agent, EnvironmentService, GenerateRequest, GenerationConfig, Trajectory, TrajectoryBuilder,
                     register_agent, scalar_reward)

DEFAULT_FEEDBACK = "Wrong, try again."


class MathMultiTurnAgent(Agent):
    def __init__(self, tokenizer: Any, gconfig: GenerationConfig, group_size: int = 8, num_turns: int = 2,
                 turn_discount: float = 0.9, feedback: str = DEFAULT_FEEDBACK, filter_uniform_groups: bool = True,
                 max_total_tokens: Optional[int] = None, credit_per_turn: bool = True) -> None:
        check_int("group_size", group_size)
        check_int("num_turns", num_turns)
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount!r}")
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.num_turns = num_turns
        self.turn_discount = float(turn_discount)
        self.filter_uniform_groups = filter_uniform_groups
        self.max_total_tokens = max_total_tokens
        if not isinstance(credit_per_turn, bool):
            raise ValueError(f"credit_per_turn must be true or false, got {credit_per_turn!r}")
        self.credit_per_turn = credit_per_turn
        self.gconfig = agent_gconfig(gconfig, tokenizer, n=1)
        # "<|user|>Wrong, try again.<|assistant|>" with the tiny tokenizer; tokenised once, appended as-is.
        self.feedback_ids = encode_chat(tokenizer, [{"role": "user", "content": feedback}], add_generation_prompt=True)

    async def _chain(self, index: int, prompt_ids: list[int], pid: str, group_id: str, env: EnvironmentService,
                     obs_queue: asyncio.Queue, act_queue: asyncio.Queue) -> Trajectory:
        b = TrajectoryBuilder(prompt_ids)
        session = f"{group_id}/{index}"
        env = await env_for(env, index)  # its own env instance when the worker passes an env group
        turn_rewards: list[float] = []
        errors: list[str] = []
        first_correct = solved = False
        termination = "max_turns"
        for turn in range(self.num_turns):
            req = GenerateRequest(qid=new_id(f"{session}/t{turn}"), input_ids=b.input_ids, gconfig=self.gconfig,
                                  session_id=session)
            sample = (await generate(obs_queue, act_queue, req)).samples[0]
            b.add_generated(sample)
            text = self.tokenizer.decode(sample.output_ids.tolist(), skip_special_tokens=True)
            _, reward, _, _, info = await env.step(text)
            turn_rewards.append(scalar_reward(reward))
            if info.get("error"):
                errors.append(str(info["error"]))
            correct = bool(info.get("correct", False))
            if turn == 0:
                first_correct = correct
            if correct:
                solved, termination = True, "solved"
                break
            if sample.finish_reason in ("abort", "length"):
                termination = sample.finish_reason
                break
            if turn == self.num_turns - 1:
                break
            if self.max_total_tokens is not None and (
                len(b) + len(self.feedback_ids) + self.gconfig.max_new_tokens > self.max_total_tokens
            ):
                termination = "length"
                break
            b.add_context(self.feedback_ids, source="feedback")
        turns = len(turn_rewards)
        reward = self.turn_discount ** (turns - 1) if solved else 0.0
        meta: dict[str, Any] = {"turns": turns, "first_correct": first_correct, "solved": solved,
                                "termination": termination, "prompt_id": pid}
        if errors:
            meta["reward_errors"] = errors
        return b.build(reward=reward, group_id=group_id, turn_rewards=turn_rewards, metadata=meta,
                       turn_discount=0.0 if self.credit_per_turn else None)

    async def collect_trajectory(self, prompt: dict[str, Any], env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        pid, group_id, prompt_ids = await start_prompt(self.tokenizer, prompt, env)
        trajs = await gather_or_cancel(self._chain(i, prompt_ids, pid, group_id, env, obs_queue, act_queue)
                                       for i in range(self.group_size))
        return filter_uniform(trajs, self.filter_uniform_groups)


register_agent("math-multi-turn", MathMultiTurnAgent)
