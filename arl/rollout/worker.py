"""The rollout (agent) worker: many `collect_trajectory` coroutines at once, gated by the controller.

Each prompt group gets its own obs/act queue pair and its own environment instance; a bridge task turns the
agent's requests into ZMQ round trips. A group that raises or overruns its deadline is dropped, its reason
counted, and its staleness budget returned to the controller; the worker goes on.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import time
from typing import Any, Awaitable, Callable, Optional, Sequence

from arl.api.agent import Agent, EnvironmentService
from arl.api.types import GenerateResponse, Trajectory
from arl.rollout.client import InferenceClient, to_request

logger = logging.getLogger("arl.rollout")

SendFn = Callable[[str, dict], Awaitable[None]]


class PromptStream:
    """Endless shuffled passes over the training rows; each worker takes every k-th row of a pass."""

    def __init__(self, rows: Sequence[dict], seed: int, shard: int = 0, num_shards: int = 1) -> None:
        if not rows:
            raise ValueError("the training data set is empty")
        self._rows = list(rows)
        self._rng = random.Random(seed)
        self._shard, self._num_shards = shard, num_shards
        self._it = iter(())
        self.epoch = 0

    def __next__(self) -> dict:
        for _ in range(2):
            try:
                return next(self._it)
            except StopIteration:
                order = list(range(len(self._rows)))
                self._rng.shuffle(order)
                mine = order[self._shard :: self._num_shards] or order
                self._it = (self._rows[i] for i in mine)
                self.epoch += 1
        raise RuntimeError("unreachable")


async def run_agent(
    agent: Agent,
    prompt: dict,
    env: EnvironmentService,
    client: InferenceClient,
    timeout: float,
) -> list[Trajectory]:
    """Run one collect_trajectory with its own queues, bridged to the inference client, under a deadline."""
    obs_q: asyncio.Queue = asyncio.Queue()
    act_q: asyncio.Queue = asyncio.Queue()

    async def answer(item: Any) -> None:
        try:
            req = to_request(item)
        except (TypeError, ValueError) as e:
            qid = item[0] if isinstance(item, tuple) and item else getattr(item, "qid", "?")
            await act_q.put(GenerateResponse(qid=str(qid), error=f"bad request: {e}"))
            return
        await act_q.put(await client.generate(req))

    async def bridge() -> None:
        inflight: set[asyncio.Task] = set()
        try:
            while True:
                t = asyncio.create_task(answer(await obs_q.get()))
                inflight.add(t)
                t.add_done_callback(inflight.discard)
        finally:
            for t in list(inflight):
                t.cancel()

    bridge_task = asyncio.create_task(bridge())
    try:
        trajs = await asyncio.wait_for(agent.collect_trajectory(prompt, env, obs_q, act_q), timeout)
    finally:
        bridge_task.cancel()
        await asyncio.gather(bridge_task, return_exceptions=True)
    if trajs is None:
        return []
    trajs = list(trajs)
    for t in trajs:
        if not isinstance(t, Trajectory):
            raise TypeError(f"collect_trajectory must return a list of Trajectory, got {type(t).__name__}")
    return trajs


class RolloutWorker:
    def __init__(
        self,
        *,
        index: int,
        make_agent: Callable[[], Agent],
        make_eval_agent: Callable[[], Agent],
        make_env: Callable[[], EnvironmentService],
        prompts: PromptStream,
        test_rows: Sequence[dict],
        client: InferenceClient,
        send_control: SendFn,
        push_group: Callable[[list[Trajectory]], Awaitable[None]],
        capacity: int,
        trajectory_timeout: float,
        eval_concurrency: int = 64,
        seed: int = 0,
    ) -> None:
        self.index = index
        self._make_agent, self._make_eval_agent, self._make_env = make_agent, make_eval_agent, make_env
        self._prompts = prompts
        self._test_rows = list(test_rows)
        self._client = client
        self._send = send_control
        self._push = push_group
        self._capacity = capacity
        self._timeout = trajectory_timeout
        self._eval_concurrency = eval_concurrency
        self._seed = seed
        self._group_ids = itertools.count()
        self._running: set[asyncio.Task] = set()
        self._wanted = 0  # acquire requests the controller has not granted yet
        self._wake = asyncio.Event()
        self.stats: collections.Counter = collections.Counter()
        self.drop_reasons: collections.Counter = collections.Counter()

    # -- controller commands -------------------------------------------------------------------------------
    def on_grant(self, n: int) -> None:
        self._wanted = max(0, self._wanted - n)
        for _ in range(n):
            t = asyncio.create_task(self._run_group(next(self._prompts)))
            self._running.add(t)
            t.add_done_callback(self._group_finished)

    def _group_finished(self, t: asyncio.Task) -> None:
        self._running.discard(t)
        self._wake.set()

    async def acquire_loop(self) -> None:
        """Keep asking the controller's staleness gate for as many groups as this worker has room for."""
        while True:
            want = self._capacity - len(self._running) - self._wanted
            if want > 0:
                self._wanted += want
                await self._send("gate_acquire", {"want": want})
            self._wake.clear()
            await self._wake.wait()

    # -- one prompt group ------------------------------------------------------------------------------------
    async def _run_group(self, prompt: dict) -> None:
        gid = f"w{self.index}g{next(self._group_ids)}"
        t0 = time.monotonic()
        reason, trajs = "accepted", []
        env: Optional[EnvironmentService] = None
        try:
            env = self._make_env()
            await asyncio.wait_for(env.reset(seed=self._seed, options=dict(prompt)), self._timeout)
            trajs = await run_agent(self._make_agent(), prompt, env, self._client, self._timeout)
            if not trajs:
                reason = "filtered"
        except asyncio.TimeoutError:
            reason = "timeout"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - one bad trajectory must not take the worker down
            reason = f"error:{type(e).__name__}"
            logger.warning("group %s (prompt %s) failed: %s: %s", gid, prompt.get("id"), type(e).__name__, e)
        finally:
            if env is not None:
                try:
                    await asyncio.wait_for(env.close(), 5.0)
                except Exception:  # noqa: BLE001
                    pass
        accepted = reason == "accepted"
        if accepted:
            for t in trajs:
                t.group_id = f"{gid}:{t.group_id}"
            await self._push(trajs)
            self.stats["trajectories"] += len(trajs)
        else:
            self.drop_reasons[reason] += 1
        self.stats["groups_" + ("accepted" if accepted else "dropped")] += 1
        rewards = [t.reward for t in trajs]
        await self._send(
            "group_done",
            {
                "accepted": accepted,
                "reason": reason,
                "n_traj": len(trajs),
                "reward_sum": float(sum(rewards)),
                "seconds": time.monotonic() - t0,
            },
        )

    # -- evaluation ----------------------------------------------------------------------------------------
    async def evaluate(self, version: int, max_prompts: int = 0) -> dict:
        """Greedy, one sample per prompt, over the held-out rows."""
        rows = self._test_rows[:max_prompts] if max_prompts else self._test_rows
        sem = asyncio.Semaphore(self._eval_concurrency)
        results: list[dict] = []
        errors = collections.Counter()
        versions: list[int] = []

        async def one(row: dict) -> None:
            async with sem:
                env = self._make_env()
                try:
                    await env.reset(seed=self._seed, options=dict(row))
                    trajs = await run_agent(self._make_eval_agent(), row, env, self._client, self._timeout)
                    if trajs:
                        results.append(trajs[0].metadata)
                        versions.extend(int(v) for v in trajs[0].versions[trajs[0].loss_mask.astype(bool)])
                except Exception as e:  # noqa: BLE001
                    errors[type(e).__name__] += 1
                finally:
                    await env.close()

        t0 = time.monotonic()
        await asyncio.gather(*(one(r) for r in rows))
        n = len(rows)
        first = sum(bool(m.get("first_correct")) for m in results)
        solved = sum(bool(m.get("solved")) for m in results)
        turns = [m.get("turns", 1) for m in results]
        return {
            "version": version,
            "n": n,
            "first_acc": first / n if n else 0.0,
            "solved_acc": solved / n if n else 0.0,
            "mean_turns": sum(turns) / len(turns) if turns else 0.0,
            "errors": dict(errors),
            "token_versions": [min(versions), max(versions)] if versions else [],
            "seconds": time.monotonic() - t0,
        }

    def heartbeat_stats(self) -> dict:
        return {
            "running": len(self._running),
            "wanted": self._wanted,
            **{k: int(v) for k, v in self.stats.items()},
            "drop_reasons": dict(self.drop_reasons),
            "client": dict(self._client.stats),
        }

    async def close(self) -> None:
        for t in list(self._running):
            t.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
