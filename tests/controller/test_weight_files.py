"""Weight files under a slow loader: the controller shell, the learner worker (its real loop on the simulated
engine, writing real files) and stand-in inference servers and rollout worker in one event loop, no processes.

One server loads slowly, eta = 4 lets the learner run up to five versions ahead of it, and the learner keeps only
one file of its own accord (`keep_versions=1`): every file a server is sent must still be there when it reads it,
each server's versions only go up, and every accepted group is trained exactly once.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from arl.api.staleness import StalenessPolicy
from arl.api.types import Trajectory
from arl.config import PPOConfig, SimLearnerConfig
from arl.controller.shell import Controller
from arl.controller.supervision import Supervisor
from arl.learner.actor import PPOActor
from arl.learner.sim_learner import SimLearner
from arl.learner.worker import LearnerWorker

from ..typed_control import typed
from ..waiting import await_until
from .fakes import FakeLauncher

STEPS, BATCH, ETA, GROUP = 24, 2, 4, 2
LOAD_SECONDS = (0.0, 0.03)  # server 1 is the slow loader


class Pull:
    def __init__(self) -> None:
        self.q: asyncio.Queue = asyncio.Queue()

    async def recv(self) -> tuple[str, list[Trajectory]]:
        return "traj", await self.q.get()


class World:
    """Routes what the controller sends to the stand-in roles and their replies back to it."""

    def __init__(self, ctl: Controller, learner: LearnerWorker, pull: Pull) -> None:
        self.ctl, self.learner, self.pull = ctl, learner, pull
        self.loaded: dict[int, list[int]] = {0: [], 1: []}  # versions each server loaded, in order
        self.version = [0, 0]
        self.missing: list[str] = []
        self.tasks: set[asyncio.Task] = set()
        self.groups = 0
        self.stats = {"received": 0, "sent": 0}

    def spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def send(self, ident: bytes, msg_type: str, payload=None) -> bool:
        payload = payload or {}
        if ident in (b"i0", b"i1") and msg_type == "update_weights":
            self.spawn(self._load(int(ident[1:]), payload["version"], payload["path"]))
        elif ident == b"L" and msg_type == "prune_weights":
            self.learner.weights.prune(payload["below"])
        elif ident == b"r0" and msg_type == "gate_grant":
            for _ in range(payload["n"]):
                self.spawn(self._group())
        elif ident == b"r0" and msg_type == "eval":
            self.spawn(self.ctl._dispatch(b"r0", "eval_done", {"version": payload["version"], "n": 1,
                                                                "first_acc": 0.0, "solved_acc": 0.0}))
        return True

    def close(self) -> None:
        pass

    async def _load(self, server: int, version: int, path: str) -> None:
        await asyncio.sleep(LOAD_SECONDS[server])
        if not os.path.exists(path):  # what an engine reading the file would hit
            self.missing.append(path)
            return
        self.loaded[server].append(version)
        self.version[server] = version
        await self.ctl._dispatch(f"i{server}".encode(), "weights_loaded", {"version": version, "index": server})

    async def _group(self) -> None:
        """A group generated on the slower of the two servers' current weights; then asks for more."""
        await asyncio.sleep(0.001)
        v = min(self.version)
        gid = f"g{self.groups}"
        self.groups += 1
        trajs = [Trajectory(input_ids=np.arange(6, dtype=np.int32), loss_mask=np.array([0, 0, 0, 1, 1, 1], np.int8),
                            logprobs=np.full(6, -1.0, np.float32), versions=np.full(6, v, np.int32),
                            reward=float(i), group_id=f"{gid}:{i}") for i in range(GROUP)]
        await self.ctl._dispatch(b"r0", "group_done", {"accepted": True, "reason": "accepted", "n_traj": GROUP})
        await self.pull.q.put(trajs)
        await self.ctl._dispatch(b"r0", "gate_acquire", {"want": 1})


@pytest.mark.asyncio
async def test_slow_loader_never_finds_its_file_deleted(tmp_path):
    ctl = Controller(run_dir=str(tmp_path), supervisor=Supervisor(num_inference=2, num_rollout=1, startup_timeout=60),
                     batch_size=BATCH, staleness=StalenessPolicy(ETA), max_concurrent_rollouts=8, total_train_steps=STEPS,
                     eval_every=0, eval_max_prompts=1, progress=False, launcher=FakeLauncher())
    ctl.spawn_roles()
    pull = Pull()
    actor = PPOActor(SimLearner(SimLearnerConfig(s_per_token=0.0, step_base_s=0.0)), PPOConfig(), staleness=StalenessPolicy(ETA))
    learner = LearnerWorker(actor=actor, pull=pull, send_control=typed(lambda t, p: ctl._dispatch(b"L", t, p)),
                            batch_size=BATCH, total_steps=STEPS, weights_dir=str(tmp_path / "weights"),
                            keep_versions=1, staleness=actor.staleness)
    world = World(ctl, learner, pull)
    ctl.router = world  # type: ignore[assignment]
    roles = [asyncio.create_task(learner.receive()), asyncio.create_task(learner.train())]
    try:
        for i in (0, 1):
            await ctl._dispatch(f"i{i}".encode(), "register", {"role": "inference", "index": i, "address": f"t:{i}"})
        await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0, "address": "t:L"})
        await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})  # all in: evaluation v0, then open
        await ctl._dispatch(b"r0", "gate_acquire", {"want": 8})
        await await_until(lambda: ctl.gate.version >= STEPS and ctl._done.is_set() or bool(world.missing),
                          what="the run to finish")
        assert world.missing == []
        for server, seq in world.loaded.items():
            assert seq == sorted(set(seq)), f"server {server} loaded {seq}"
            assert seq[-1] == STEPS
        assert len(world.loaded[1]) < STEPS  # the slow loader skipped versions (coalesced), so files piled up
        # nothing lost: every accepted group reached the learner and was trained once or is still buffered
        await ctl._dispatch(b"L", "heartbeat", {"role": "learner", "index": 0, "stats": learner.heartbeat_stats()})
        acc = ctl.accounting()
        assert acc["lost_accepted_groups"] == 0 and acc["learner_balance"] == 0
        assert learner.stats["trained_twice"] == 0 and learner.stats["stale_groups_dropped"] == 0
        assert learner.stats["trained_groups"] == STEPS * BATCH
        # and old files did go: only what a server may still read, and the newest, is left
        left = sorted(int(f[1:].split(".")[0]) for f in os.listdir(tmp_path / "weights"))
        assert left == [STEPS]
    finally:
        for t in [*roles, *world.tasks]:
            t.cancel()
        await asyncio.gather(*roles, *world.tasks, return_exceptions=True)
        ctl.reporter.close()
