"""Controller bookkeeping for faults, without real roles: who may talk to it, which groups a rollout worker holds,
and what a restart returns to the staleness gate."""

from __future__ import annotations

import collections
import json
import sys

import pytest

from arl.launcher.controller import Controller


class FakeRouter:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, str, dict]] = []
        self.stats = {"received": 0, "sent": 0, "malformed": 0, "dropped": 0}

    async def send(self, ident, msg_type, payload=None):
        self.sent.append((ident, msg_type, payload))
        return True

    def close(self):
        pass


def make_controller(tmp_path, **kw) -> Controller:
    ctl = Controller(run_dir=str(tmp_path), num_inference=1, num_rollout=2, batch_size=2, max_head_offpolicyness=3,
                     max_concurrent_rollouts=8, total_train_steps=4, eval_every=0, eval_max_prompts=4,
                     startup_timeout=60, progress=False, **kw)
    ctl.router = FakeRouter()
    return ctl


async def feed(ctl: Controller, ident: bytes, msg_type: str, payload: dict) -> None:
    if ctl._admit(ident, msg_type, payload):
        await ctl._handle(ident, msg_type, payload)


@pytest.mark.asyncio
async def test_only_registered_peers_are_heard(tmp_path):
    ctl = make_controller(tmp_path)
    await feed(ctl, b"x", "error", {"message": "stop the run"})
    await feed(ctl, b"x", "group_done", {"accepted": True, "reason": "accepted"})
    await feed(ctl, b"x", "register", {"role": "rollout", "index": 7})  # no such worker
    await feed(ctl, b"x", "register", {"role": "wizard", "index": 0})
    await feed(ctl, b"x", "register", {"role": "inference", "index": 0})  # no address
    assert ctl._failure is None and ctl.gate.running == 0 and ctl.peers == {}
    assert ctl.control_errors == {"unknown_peer": 2, "bad_register": 3}


@pytest.mark.asyncio
async def test_restart_returns_the_held_groups(tmp_path):
    ctl = make_controller(tmp_path, max_restarts=1)
    try:
        await feed(ctl, b"r0", "register", {"role": "rollout", "index": 0})
        await feed(ctl, b"r1", "register", {"role": "rollout", "index": 1})
        ctl._training_open = True
        await feed(ctl, b"r0", "gate_acquire", {"want": 3})
        await feed(ctl, b"r1", "gate_acquire", {"want": 3})
        assert ctl.gate.running == 6 and ctl._held == {0: 3, 1: 3}
        await feed(ctl, b"r1", "group_done", {"accepted": True, "reason": "accepted", "n_traj": 4})
        await feed(ctl, b"r1", "group_done", {"accepted": False, "reason": "filtered", "n_traj": 0})
        assert ctl._held[1] == 1 and ctl.accepted_groups == 1 and ctl.accepted_trajectories == 4
        # rollout1 dies holding one group: it is released (budget back), counted as lost, and the process respawned
        ctl.procs.spawn("rollout1", [sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path / "r1.log"))
        ctl.role_stats[("rollout", 1)] = {"prompt_position": 7, "env": {"env_timeout": 2}}
        assert await ctl._restart_rollout("rollout1", "exited with code -9")
        assert ctl.gate.running == 3 and ctl.lost_groups == 1 and ctl._group_reasons["lost_worker_died"] == 1
        assert ("rollout", 1) not in ctl.peers and 1 not in ctl._held and ctl.restarts == 1
        assert ctl.procs.children["rollout1"].proc.poll() is None  # the new one runs
        # a late message from the dead incarnation is not counted twice
        await feed(ctl, b"r1", "group_done", {"accepted": True, "reason": "accepted", "n_traj": 4})
        assert ctl.gate.running == 3 and ctl.control_errors["unknown_peer"] == 1
        # a process that dies before registering is not restarted (a restart would fail the same way) ...
        assert not await ctl._restart_rollout("rollout1", "died while starting")
        # ... and once it registered, one more failure is over the cap: not restarted (the caller stops the run)
        await feed(ctl, b"r1b", "register", {"role": "rollout", "index": 1})
        assert ctl.router.sent[-1][:2] == (b"r1b", "ack") and ctl.router.sent[-1][2]["prompt_position"] == 7
        assert ctl.accounting()["env"] == {"env_timeout": 2}  # the dead incarnation's counts are kept
        assert not await ctl._restart_rollout("rollout1", "again") and ctl.restarts == 1
        with open(tmp_path / "metrics.jsonl") as f:
            recs = [json.loads(line) for line in f]
        assert [r["type"] for r in recs] == ["worker_restarted"] and recs[0]["lost_groups"] == 1
        acct = ctl.accounting()
        assert acct["lost_in_flight_groups"] == 1 and acct["rollout_restarts"] == 1
    finally:
        ctl.procs.terminate(1.0)
        ctl.metrics.close()


@pytest.mark.asyncio
async def test_grants_to_an_unregistered_identity_are_not_held(tmp_path):
    ctl = make_controller(tmp_path)
    ctl._training_open = True
    ctl._wants.append([b"ghost", 2])
    await ctl._grant()
    assert ctl._held == collections.Counter()
    ctl.metrics.close()


@pytest.mark.asyncio
async def test_inference_restart_rejoins_only_with_the_newest_weights(tmp_path):
    ctl = Controller(run_dir=str(tmp_path), num_inference=2, num_rollout=1, batch_size=2, max_head_offpolicyness=3,
                     max_concurrent_rollouts=8, total_train_steps=10, eval_every=0, eval_max_prompts=4,
                     startup_timeout=60, progress=False, tolerate_inference_loss=True, restart_inference=True,
                     max_inference_restarts=2)
    ctl.router = FakeRouter()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    try:
        for i in (0, 1):
            await feed(ctl, f"i{i}".encode(), "register", {"role": "inference", "index": i, "address": f"tcp://a:{i}"})
        await feed(ctl, b"r0", "register", {"role": "rollout", "index": 0})
        await feed(ctl, b"L", "register", {"role": "learner", "index": 0, "address": "tcp://l:1"})
        ctl._published[3] = "/w/v3"
        ctl.procs.spawn("inference1", sleeper, str(tmp_path / "i1.log"))
        ctl.procs.children["inference1"].proc.kill()
        ctl.procs.children["inference1"].proc.wait()
        assert await ctl._lose_inference("inference1", "exited with code -9")
        assert ctl.lost_inference == {1} and ctl._rejoining == {1} and ctl.inference_restarts == 1
        assert ctl.procs.children["inference1"].proc.poll() is None  # respawned
        sent = lambda: [(i, t, p) for i, t, p in ctl.router.sent]  # noqa: E731
        assert (b"r0", "worker_lost", {"role": "inference", "indices": [1]}) in sent()
        # it registers at a new address: told to load the newest version; still out of the routing
        await feed(ctl, b"i1b", "register", {"role": "inference", "index": 1, "address": "tcp://b:1"})
        assert sent()[-1] == (b"i1b", "update_weights", {"version": 3, "path": "/w/v3"})
        # v4 came out meanwhile: its ack of v3 is not enough, it is told to load v4
        ctl._published[4] = "/w/v4"
        await feed(ctl, b"i1b", "weights_loaded", {"version": 3, "index": 1})
        assert sent()[-1] == (b"i1b", "update_weights", {"version": 4, "path": "/w/v4"}) and 1 in ctl.lost_inference
        await feed(ctl, b"i1b", "weights_loaded", {"version": 4, "index": 1})
        assert ctl.lost_inference == set() and ctl._rejoining == set()
        assert sent()[-1] == (b"r0", "worker_back", {"role": "inference", "index": 1, "address": "tcp://b:1"})
        # it dies again after rejoining: lost and restarted again (cap 2); then the cap holds
        ctl.procs.children["inference1"].proc.kill()
        ctl.procs.children["inference1"].proc.wait()
        assert await ctl._lose_inference("inference1", "exited with code -9") and ctl.inference_restarts == 2
        ctl.procs.children["inference1"].proc.kill()  # the restart dies before it registered
        ctl.procs.children["inference1"].proc.wait()
        assert await ctl._lose_inference("inference1", "died while starting")  # lost again, over the cap
        assert ctl.inference_restarts == 2 and ctl.procs.children["inference1"].proc.poll() is not None
        kinds = [json.loads(line)["type"] for line in open(tmp_path / "metrics.jsonl")]
        assert kinds == ["worker_lost", "worker_restarted", "worker_back", "worker_lost", "worker_restarted",
                         "worker_lost"]
        assert ctl.accounting()["inference_restarts"] == 2
    finally:
        ctl.procs.terminate(1.0)
        ctl.metrics.close()
