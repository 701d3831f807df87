"""Self-play on a two-player text game (registered as agent "self-play"; the env is the referee, e.g. env "nim").

Each seat's turns are a chat of its own: the seat sees the env's observation when it is its turn
(`<|user|>pile 12<|assistant|>`) and answers; what the other seat did shows only in the next observation. So each
seat's trajectory is a plain multi-turn chat whose generated tokens are that seat's, and the learner needs no
per-policy view for self-play with one policy.

- Training, `opponent` unset (self-play): the run's policy plays both seats; a group of `group_size` trajectories
  is `group_size / 2` games, both seats of each. Rewards are zero-sum: 1 for the winner's trajectory, 0 for the
  loser's (0.5 each for a game cut at `max_turns`), so the group-relative advantage is +-0.5.
- Training with `opponent` (a named policy the inference servers serve, `policies:`): `group_size` games against
  it, the run's seat alternating; only the run's seat is returned (the opponent's turns are never trained).
- Training with `opponent` and `train_opponent=True` (the opponent a trainable listed policy, `policies: [{name:
  rival, adapter: base, trainable: true}]`): `group_size / 2` games against it, seats alternating, and both seats
  returned, each trajectory recorded under its seat's policy, so each policy's learner trains its own seat (two
  policies, separately trained, in one run: `experiment=self-play-rivals`).
- Evaluation (a group of one): one game, the run's policy in seat `seed % 2` of the row (env-seeds rows alternate)
  against `eval_opponent`, e.g. the frozen start (`policies=[{name: start, adapter: base}]`); `first_correct` and
  `solved` say whether it won, so the run's held-out accuracy is its win rate.

The env must say in `info` whose turn it is (`to_move`: 0 or 1) and, once the game is over, who won (`winner`);
numbers it reports in `info["move_stats"]` are summed per seat into the trajectory's metadata (Nim: winning
chances and winning moves taken, so the eval record's `traj_means` show how well the policy plays).
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from arl.agents.common import agent_gconfig, check_int, encode_chat, env_for, filter_uniform, gather_or_cancel, \
    generate, new_id
from arl.api import Agent, EnvironmentService, GenerateRequest, GenerationConfig, Trajectory, TrajectoryBuilder, \
    register_agent

Seats = tuple[Optional[str], Optional[str]]  # the policy of seat 0 and seat 1 (None: the run's own)
OWN = None


class SelfPlayAgent(Agent):
    def __init__(self, tokenizer: Any, gconfig: GenerationConfig, group_size: int = 8, max_turns: int = 32,
                 opponent: Optional[str] = None, eval_opponent: Optional[str] = None,
                 filter_uniform_groups: bool = True, train_opponent: bool = False) -> None:
        check_int("group_size", group_size)
        check_int("max_turns", max_turns)
        if not isinstance(train_opponent, bool):
            raise ValueError(f"self-play: train_opponent must be true or false, got {train_opponent!r}")
        if train_opponent and opponent is None:
            raise ValueError("self-play: train_opponent=true needs opponent (the trainable listed policy to train)")
        if group_size > 1 and (opponent is None or train_opponent) and group_size % 2:
            raise ValueError(f"self-play: group_size must be even (two seats a game), got {group_size}")
        for name, v in (("opponent", opponent), ("eval_opponent", eval_opponent)):
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"self-play: {name} must be a policy's name or unset, got {v!r}")
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.max_turns = max_turns
        self.opponent, self.eval_opponent, self.train_opponent = opponent, eval_opponent, train_opponent
        self.filter_uniform_groups = filter_uniform_groups
        self.gconfig = agent_gconfig(gconfig, tokenizer, n=1)

    def games(self, prompt: dict[str, Any]) -> list[tuple[Seats, tuple[int, ...]]]:
        """(seat policies, seats returned) of each game of one group."""
        if self.group_size == 1:  # evaluation
            own = int(prompt.get("seed", 0)) % 2
            seats: list[Optional[str]] = [self.eval_opponent, self.eval_opponent]
            seats[own] = OWN
            return [((seats[0], seats[1]), (own,))]
        if self.opponent is None:
            return [((OWN, OWN), (0, 1)) for _ in range(self.group_size // 2)]
        if self.train_opponent:  # both seats returned: each policy's learner trains its own
            return [(((OWN, self.opponent) if g % 2 == 0 else (self.opponent, OWN)), (0, 1))
                    for g in range(self.group_size // 2)]
        return [(((OWN, self.opponent) if g % 2 == 0 else (self.opponent, OWN)), (g % 2,))
                for g in range(self.group_size)]

    async def _game(self, g: int, seats: Seats, keep: tuple[int, ...], prompt: dict[str, Any], group_id: str,
                    env: EnvironmentService, obs_queue: asyncio.Queue, act_queue: asyncio.Queue) -> list[Trajectory]:
        env = await env_for(env, g)
        obs, info = await env.reset(options=dict(prompt))
        session = f"{group_id}/{g}"
        builders: list[Optional[TrajectoryBuilder]] = [None, None]
        turns = [0, 0]
        move_stats: list[dict[str, float]] = [{}, {}]
        termination = "max_turns"
        for t in range(self.max_turns):
            s = int(info["to_move"])
            ids = encode_chat(self.tokenizer, [{"role": "user", "content": str(obs)}], add_generation_prompt=True)
            b = builders[s]
            if b is None:
                b = builders[s] = TrajectoryBuilder(ids)
            else:
                b.add_context(ids, source="observation")
            req = GenerateRequest(qid=new_id(f"{session}/t{t}"), input_ids=b.input_ids, gconfig=self.gconfig,
                                  session_id=f"{session}/s{s}", policy=seats[s])
            sample = (await generate(obs_queue, act_queue, req)).samples[0]
            b.add_generated(sample, policy=seats[s])
            turns[s] += 1
            obs, _, done, truncated, info = await env.step(
                self.tokenizer.decode(sample.output_ids.tolist(), skip_special_tokens=True))
            for k, v in (info.get("move_stats") or {}).items():
                move_stats[s][k] = move_stats[s].get(k, 0) + v
            if sample.finish_reason == "abort":
                termination = "abort"
                break
            if done or truncated:
                termination = "illegal" if info.get("illegal") else "ended"
                break
        winner = info.get("winner")
        trajs = []
        for s in keep:
            b = builders[s]
            if b is None:  # the game ended before this seat moved (its opponent's first move was illegal)
                if self.group_size > 1:
                    continue  # nothing to train
                # evaluation: the game still counts (a trajectory of the observation alone, no token to train)
                b = TrajectoryBuilder(encode_chat(self.tokenizer, [{"role": "user", "content": str(obs)}],
                                                  add_generation_prompt=True))
            won = winner == s
            reward = 0.5 if winner is None else float(won)
            ended = "opponent_illegal" if termination == "illegal" and won else termination  # whose move it was
            meta = {"turns": turns[s], "first_correct": won, "solved": won, "seat": s,
                    "prompt_id": str(prompt.get("id", "")), "termination": ended,
                    "opponent": seats[1 - s] or "self", **move_stats[s]}
            trajs.append(b.build(reward=reward, group_id=group_id, metadata=meta))
        return trajs

    async def collect_trajectory(self, prompt: dict[str, Any], env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        group_id = new_id(str(prompt.get("id", "game")))
        games = await gather_or_cancel(self._game(g, seats, keep, prompt, group_id, env, obs_queue, act_queue)
                                       for g, (seats, keep) in enumerate(self.games(prompt)))
        trajs = [t for game in games for t in game]
        return filter_uniform(trajs, self.filter_uniform_groups)


register_agent("self-play", SelfPlayAgent)
