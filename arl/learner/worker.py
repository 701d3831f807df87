"""The learner worker: buffers finished groups, trains on B groups per step, publishes weights."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Any, Awaitable, Callable

from arl.api.engine import LearnerEngine
from arl.api.types import Trajectory

logger = logging.getLogger("arl.learner")


class LearnerWorker:
    def __init__(
        self,
        *,
        engine: LearnerEngine,
        pull: Any,
        send_control: Callable[[str, dict], Awaitable[None]],
        batch_size: int,
        total_steps: int,
        weights_dir: str,
        keep_versions: int = 3,
        max_head_offpolicyness: int | None = None,
    ) -> None:
        self.engine = engine
        self.pull = pull
        self._send = send_control
        self.batch_size = batch_size
        self.total_steps = total_steps
        self.weights_dir = weights_dir
        self.keep_versions = max(1, keep_versions)
        self.eta = max_head_offpolicyness
        self.buffer: collections.deque[list[Trajectory]] = collections.deque()
        self._arrived = asyncio.Event()
        self._exported: collections.deque[str] = collections.deque()
        self.stats = {"groups_received": 0, "trajectories_received": 0, "steps": 0, "idle_seconds": 0.0,
                      "train_seconds": 0.0, "staleness_violations": 0, "stale_groups_dropped": 0}
        os.makedirs(weights_dir, exist_ok=True)

    async def receive(self) -> None:
        while True:
            msg_type, group = await self.pull.recv()
            if msg_type != "traj" or not group:
                continue
            self.buffer.append(group)
            self.stats["groups_received"] += 1
            self.stats["trajectories_received"] += len(group)
            self._arrived.set()

    def _drop_stale(self) -> int:
        """Remove buffered groups with a token older than `version - eta` (long-tailed stragglers)."""
        if self.eta is None:
            return 0
        oldest_ok = self.engine.version - self.eta
        keep = [g for g in self.buffer if min(t.min_version() for t in g) >= oldest_ok]
        dropped = len(self.buffer) - len(keep)
        if dropped:
            self.buffer = collections.deque(keep)
            self.stats["stale_groups_dropped"] += dropped
        return dropped

    async def next_batch(self) -> tuple[list[Trajectory], float]:
        """Wait for B fresh-enough groups (FIFO); returns the flattened batch and the seconds spent waiting."""
        t0 = time.monotonic()
        while True:
            dropped = self._drop_stale()
            if dropped:
                logger.info("dropped %d groups staler than eta=%s; their budget goes back", dropped, self.eta)
                await self._send("groups_dropped", {"n": dropped, "reason": "stale"})
            if len(self.buffer) >= self.batch_size:
                break
            self._arrived.clear()
            await self._arrived.wait()
        groups = [self.buffer.popleft() for _ in range(self.batch_size)]
        return [t for g in groups for t in g], time.monotonic() - t0

    async def train(self) -> None:
        while self.engine.version < self.total_steps:
            batch, waited = await self.next_batch()
            self.stats["idle_seconds"] += waited
            t0 = time.monotonic()
            metrics = await asyncio.to_thread(self.engine.train_step, batch)
            path = os.path.join(self.weights_dir, f"v{self.engine.version}.safetensors")
            await asyncio.to_thread(self.engine.export_weights, path)
            train_s = time.monotonic() - t0
            self.stats["train_seconds"] += train_s
            self.stats["steps"] += 1
            head = metrics.get("head_offpolicyness")
            if self.eta is not None and head is not None and head > self.eta:
                self.stats["staleness_violations"] += 1
                logger.error("batch head off-policyness %s exceeds eta=%d", head, self.eta)
            metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
            metrics.update(learner_wait_seconds=waited, learner_step_seconds=train_s,
                           samples_per_s=len(batch) / max(train_s + waited, 1e-9),
                           buffered_groups=len(self.buffer),
                           staleness_violations=self.stats["staleness_violations"],
                           stale_groups_dropped=self.stats["stale_groups_dropped"])
            await self._send("weights_published", {"version": self.engine.version, "path": path,
                                                   "metrics": metrics})
            self._prune(path)

    def _prune(self, newest: str) -> None:
        self._exported.append(newest)
        while len(self._exported) > self.keep_versions:
            old = self._exported.popleft()
            try:
                os.remove(old)
            except OSError:
                pass

    def heartbeat_stats(self) -> dict:
        return {**self.stats, "buffered_groups": len(self.buffer), "version": self.engine.version}
