"""The agent guide's code (shared/seeds: AReaL's "Rollout and Agentic RL") runs as written through the rollout path.

Its stateless env rewards every answer of a step with one number each (`step((qid, answers))` returns a list) and
its agent reads `success[0]`. The two classes below are the guide's code; the parts the guide leaves out as `...`
are filled with the least ARL glue (marked "glue"), the imports are ARL's, nothing else is changed.
"""

from __future__ import annotations

import asyncio
import collections
from typing import List, Tuple

import numpy as np
import pytest

from arl.api import (
    Agent,
    EnvironmentService,
    GenerateResponse,
    GenerationConfig,
    SampleOutput,
    TrajectoryBuilder,
    check_reward,
)
from arl.envs.math import exact_number_match
from arl.models.tiny import build_char_tokenizer
from arl.rollout.guards import EnvCallError, GuardedEnv
from arl.rollout.worker import PromptStream, RolloutWorker

from ..typed_control import typed

pytestmark = pytest.mark.timeout(60)

BundledGenerationOutputs = GenerateResponse  # glue: AReaL's name for the engine's answer


def math_verify_call(answers: List[str], solutions: List[str]) -> List[float]:
    """glue: AReaL's reward call, one reward per answer."""
    return [exact_number_match(a, s) for a, s in zip(answers, solutions)]


# ------------------------------------------------------------------------------------------ the guide's code


class MathMultiTurnAgent(Agent):

    def __init__(self, tokenizer, gconfig: GenerationConfig, num_turns: int = 3, my_param: float = 1.0) -> None:
        # glue: the guide's __init__ is not shown
        self.tokenizer = tokenizer
        self.gconfig = gconfig
        self.num_turns = num_turns
        self.my_param = my_param

    async def collect_trajectory(
        self,
        prompt,
        env: EnvironmentService,
        obs_queue: asyncio.Queue,
        act_queue: asyncio.Queue,
    ):
        # glue: the prompt's id and tokens, a builder for the trajectory
        qid = prompt["id"]
        token_ids = self.tokenizer(self.tokenizer.apply_chat_template(
            [dict(content=prompt["prompt"], role="user")], add_generation_prompt=True, tokenize=False))["input_ids"]
        builder = TrajectoryBuilder(token_ids)
        rewards = []
        for turn in range(self.num_turns):
            await obs_queue.put((qid, token_ids, self.gconfig))
            act: BundledGenerationOutputs = await act_queue.get()
            # glue: the answers' text, the first answer continues the chat
            answers = [self.tokenizer.decode(s.output_ids.tolist(), skip_special_tokens=True) for s in act.samples]
            builder.add_generated(act.samples[0])
            token_ids.extend(act.samples[0].output_ids.tolist())
            _, success, *_ = await env.step((qid, answers))
            rewards.append(success[0])  # glue
            feedback = None
            if success[0]:
                feedback = "Congratulations! You are correct!"
            else:
                feedback = "Unfortunately your answer is wrong. Let's try again."

            feedback = "\n" + self.tokenizer.apply_chat_template(
                [dict(content=feedback, role="user")],
                add_generation_prompt=True,
                tokenize=False,
            )
            feedback = self.tokenizer(feedback)["input_ids"]
            token_ids.extend(feedback)
            builder.add_context(feedback, source="feedback")  # glue
            if success[0]:  # glue: stop once right
                break
        # glue: one trajectory, rewarded by its last answer (a one-element list is accepted as its number)
        return [builder.build(reward=[rewards[-1] * self.my_param], group_id=qid, turn_rewards=rewards)]


class MathCodeSingleStepEnv(EnvironmentService):

    def __init__(self, id2solution: dict[str, str]) -> None:  # glue: AReaL loads these from the dataset
        self.id2solution = id2solution

    async def step(self, action: Tuple[str, List[str]]):
        qid, answers = action
        solutions = [self.id2solution[qid]] * len(answers)  # glue
        # Make `math_verify_call` async
        format_rewards = await asyncio.to_thread(
            math_verify_call,
            answers,
            solutions,
        )
        return None, format_rewards, True, False, {}


# ------------------------------------------------------------------------------------------------- the test

TOK = build_char_tokenizer()


class TurnClient:
    """Answers a qid's first request with a wrong number and later ones with the right one, `n` samples each."""

    def __init__(self, wrong: str, right: str) -> None:
        self.seen: collections.Counter = collections.Counter()
        self.wrong, self.right = wrong, right
        self.stats: collections.Counter = collections.Counter()

    async def generate(self, req):
        text = self.wrong if self.seen[req.qid] == 0 else self.right
        self.seen[req.qid] += 1
        ids = TOK(text)["input_ids"] + [TOK.eos_token_id]
        s = SampleOutput(np.asarray(ids, np.int32), np.full(len(ids), -0.5, np.float32), np.zeros(len(ids), np.int32),
                         "stop")
        return GenerateResponse(qid=req.qid, samples=[s] * req.gconfig.n)


@pytest.mark.asyncio
async def test_seed_guide_agent_and_env_run_through_the_rollout_worker():
    rows = [{"id": "q1", "prompt": "6*7="}]
    sent, pushed = [], []

    async def send(msg_type, payload):
        sent.append((msg_type, payload))

    async def push(group):
        pushed.append(group)

    worker = RolloutWorker(
        index=0,
        make_agent=lambda: MathMultiTurnAgent(TOK, GenerationConfig(n=2, max_new_tokens=8), my_param=2.0),
        make_eval_agent=lambda: MathMultiTurnAgent(TOK, GenerationConfig(n=2, max_new_tokens=8)),
        make_env=lambda: MathCodeSingleStepEnv({"q1": "42"}),
        prompts=PromptStream(rows, seed=0),
        test_rows=rows,
        client=TurnClient("41", "42"),
        send_control=typed(send),
        push_group=push,
        capacity=1,
        trajectory_timeout=30.0,
    )
    worker.on_grant(1)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while worker._running:
        assert loop.time() < deadline, "the group did not finish"
        await asyncio.sleep(0.01)
    (done,) = [p for t, p in sent if t == "group_done"]
    assert done["accepted"] and done["reason"] == "accepted", done
    (traj,) = pushed[0]
    assert traj.reward == 2.0 and traj.turn_rewards == [0.0, 1.0]
    text = TOK.decode(traj.input_ids.tolist())
    assert text == ("<|user|>6*7=<|assistant|>41<eos>\n<|user|>Unfortunately your answer is wrong. Let's try again."
                    "<|assistant|>42<eos>\n<|user|>Congratulations! You are correct!<|assistant|>")
    assert worker.env_stats["env_calls"] >= 2 and not worker.drop_reasons


class ListRewardEnv(EnvironmentService):
    def __init__(self, reward) -> None:
        self.reward = reward

    async def step(self, action):
        return None, self.reward, True, False, {}


@pytest.mark.asyncio
@pytest.mark.parametrize("reward", [1.0, 0, True, [1.0, 0.0], (0.5,), np.array([1.0, 0.0], np.float32),
                                    np.float32(0.25)])
async def test_guard_accepts_a_number_or_one_finite_number_per_answer(reward):
    out = await GuardedEnv(ListRewardEnv(reward), timeout=5).step(("q", ["a", "b"]))
    assert out[1] is reward


@pytest.mark.asyncio
@pytest.mark.parametrize("reward", [float("nan"), float("inf"), "1.0", [], [1.0, float("nan")], [[1.0], [0.0]],
                                    ["1"], None, {"r": 1.0}, np.zeros((2, 1))])
async def test_guard_still_refuses_anything_else(reward):
    env = GuardedEnv(ListRewardEnv(reward), timeout=5)
    with pytest.raises(EnvCallError, match="non-finite or non-numeric reward"):
        await env.step(("q", ["a"]))
    assert env.failure == "env_error:step:BadReward"


def test_check_reward_normalises():
    assert check_reward(1) == 1.0 and check_reward([1, 0.5]) == [1.0, 0.5]
    assert check_reward(np.array([0.0, 1.0])) == [0.0, 1.0]
