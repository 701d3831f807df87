"""`arl.ctl scale` in the controller, without processes: refusals change nothing; a joining server is started,
routed to once it loaded the newest weights; a leaving one is drained (no new requests, in-flight ones finish),
then stopped and its leftovers re-sent."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest

from arl.controller.scaling import Scaling, write_control_file
from tests.controller.test_controller_faults import make_controller


def scaled(ctl) -> list[dict]:
    return [p for _, t, p in ctl.router.sent if t == "scaled"]


def sent(ctl, msg_type: str) -> list[tuple[bytes, dict]]:
    return [(i, p) for i, t, p in ctl.router.sent if t == msg_type]


async def settle(ctl) -> None:
    for _ in range(200):
        if not ctl._handlers["scale"].__self__._busy and not ctl._handlers["scale"].__self__._tasks:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("scale did not finish")


async def register_all(ctl) -> None:
    for ident, reg in ((b"i0", {"role": "inference", "index": 0, "address": "tcp://a:0"}),
                       (b"i1", {"role": "inference", "index": 1, "address": "tcp://a:1"}),
                       (b"L", {"role": "learner", "index": 0}), (b"r0", {"role": "rollout", "index": 0})):
        await ctl._dispatch(ident, "register", reg)


@pytest.fixture
def run(tmp_path):
    ctl = make_controller(tmp_path, num_inference=2, num_rollout=1)
    ctl.launcher.elastic = True
    key = write_control_file(str(tmp_path), "tcp://127.0.0.1:1", signed=False)
    ctl._handlers.update(Scaling(ctl, key=key, drain_timeout_s=2.0).handlers)
    yield ctl, key
    ctl.reporter.close()


def test_control_file_is_private(tmp_path):
    key = write_control_file(str(tmp_path), "tcp://127.0.0.1:5", signed=True)
    path = tmp_path / "control.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text()) == {"controller": "tcp://127.0.0.1:5", "key": key, "signed": True,
                                            "pid": os.getpid()}
    # a secret the run made itself (Ray) is kept there for `arl.ctl` on this machine
    write_control_file(str(tmp_path), "tcp://10.0.0.1:5", signed=True, secret="made-for-the-run")
    assert json.loads(path.read_text())["secret"] == "made-for-the-run"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.asyncio
async def test_refusals_change_nothing(run):
    ctl, key = run
    await ctl._dispatch(b"ctl", "scale", {"token": "nope", "changes": {"inference": 1}})
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"judge": 1}})
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"inference": "+x"}})
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"inference": -2}})  # would leave none
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {}})
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"rollout": -1}})  # would leave none
    ctl._handlers["scale"].__self__.rollout_refusal = "rollout.num_env_groups=4 partitions the env groups"
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"rollout": 1, "inference": 1}})
    replies = scaled(ctl)
    assert [r["ok"] for r in replies] == [False] * 7
    assert "wrong control key" in replies[0]["message"] and "'judge'" in replies[1]["message"]
    assert "at least one" in replies[3]["message"] and "1 rollout workers" not in replies[5]["message"]
    assert "0 rollout workers: a run needs at least one" in replies[5]["message"]
    assert "num_env_groups" in replies[6]["message"]
    ctl.launcher.elastic = False
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"inference": 1}})
    assert "cannot start roles mid-run" in scaled(ctl)[-1]["message"]
    assert ctl.weights.num_servers == 2 and ctl.sup.num_inference == 2 and ctl.launcher.spawns == [
        "inference0", "inference1", "learner", "rollout0"]


@pytest.mark.asyncio
async def test_join_then_drain(run):
    ctl, key = run
    await register_all(ctl)
    await ctl._dispatch(b"L", "weights_published", {"version": 1, "path": "/w/v1"})
    for ident, i in ((b"i0", 0), (b"i1", 1)):
        await ctl._dispatch(ident, "weights_loaded", {"version": 1, "index": i})
    assert ctl.weights.live == 1

    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"inference": 1}})
    await settle(ctl)
    assert scaled(ctl)[-1]["ok"] and "inference2" in ctl.launcher.spawns
    assert ctl.weights.num_servers == 3 and 2 in ctl.weights.lost and not sent(ctl, "worker_back")
    await ctl._dispatch(b"i2", "register", {"role": "inference", "index": 2, "address": "tcp://a:2"})
    assert sent(ctl, "update_weights")[-1] == (b"i2", {"version": 1, "path": "/w/v1"})  # the newest first
    assert not sent(ctl, "worker_back")  # not routed to before it has it
    await ctl._dispatch(b"i2", "weights_loaded", {"version": 1, "index": 2})
    assert sent(ctl, "worker_back") == [(b"r0", {"role": "inference", "index": 2, "address": "tcp://a:2"})]
    assert 2 not in ctl.weights.lost

    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"inference": -1}})
    await asyncio.sleep(0.05)
    assert sent(ctl, "worker_draining") == [(b"r0", {"role": "inference", "index": 2})]
    assert 2 in ctl.weights.lost and not ctl.launcher.killed  # in flight still: waits
    await ctl._dispatch(b"i2", "heartbeat", {"role": "inference", "index": 2, "stats": {"inflight": 3}})
    await asyncio.sleep(0.3)
    assert not ctl.launcher.killed
    await ctl._dispatch(b"i2", "heartbeat", {"role": "inference", "index": 2, "stats": {"inflight": 0}})
    await settle(ctl)
    assert ctl.launcher.killed == ["inference2"] and scaled(ctl)[-1]["ok"]
    assert sent(ctl, "worker_lost")[-1] == (b"r0", {"role": "inference", "indices": [2]})
    assert ctl.roster.addresses["retired"] == [2] and ("inference", 2) not in ctl.peers
    assert not await_dead(ctl)  # its exit was expected: not a failure
    records = [json.loads(x) for x in open(os.path.join(ctl.run_dir, "metrics.jsonl"))]
    assert [r["change"] for r in records if r.get("type") == "scale"] == [1, -1]


def await_dead(ctl) -> list:
    return ctl.launcher.dead()


@pytest.mark.asyncio
async def test_a_preemption_notice_drains_the_server(run):
    ctl, _ = run
    await register_all(ctl)
    await ctl._dispatch(b"i1", "leaving", {"grace_s": 0.5})  # SIGTERM on its machine
    await asyncio.sleep(0.05)
    assert sent(ctl, "worker_draining") == [(b"r0", {"role": "inference", "index": 1})] and 1 in ctl.weights.lost
    await settle(ctl)  # it never said it was idle: stopped at the end of its grace, leftovers re-sent
    assert ctl.launcher.killed == ["inference1"] and not ctl.launcher.dead()
    assert sent(ctl, "worker_lost") == [(b"r0", {"role": "inference", "indices": [1]})]
    assert [r["type"] for r in map(json.loads, open(os.path.join(ctl.run_dir, "metrics.jsonl")))
            if r["type"] == "preempted"] == ["preempted"]


@pytest.mark.asyncio
async def test_a_rollout_worker_joins_then_drains_and_its_prompt_streams_go_on_elsewhere(run):
    ctl, key = run
    await register_all(ctl)
    await ctl.grant(ctl.admission.open())
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"rollout": 2}})
    await settle(ctl)
    assert scaled(ctl)[-1]["ok"] and ctl.sup.rollouts() == [0, 1, 2]
    assert ctl.launcher.spawns[-2:] == ["rollout1", "rollout2"]
    await ctl._dispatch(b"r1", "register", {"role": "rollout", "index": 1})
    await ctl._dispatch(b"r2", "register", {"role": "rollout", "index": 2})
    assert sent(ctl, "ack")[-1] == (b"r2", {"ok": True})  # no prompt position: a new stream, from its start
    await ctl._dispatch(b"r2", "gate_acquire", {"want": 2, "incarnation": "c"})
    assert sent(ctl, "gate_grant")[-1] == (b"r2", {"n": 2})
    await ctl._dispatch(b"r1", "heartbeat", {"role": "rollout", "index": 1, "stats": {"prompt_position": {"1": 3}}})

    # rollout -2: the newest two go (never rollout0); each drains, then its streams go to rollout0
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"rollout": -2}})
    await asyncio.sleep(0.05)
    assert {i for i, _ in sent(ctl, "drain")} == {b"r1", b"r2"} and not ctl.launcher.killed
    await ctl._dispatch(b"r2", "gate_acquire", {"want": 5, "incarnation": "c"})  # sent before it heard: ignored
    assert ctl.admission.waiting() == 0
    await ctl._dispatch(b"r1", "heartbeat", {"role": "rollout", "index": 1,
                                             "stats": {"prompt_position": {"1": 4}, "running": 0, "draining": True}})
    await ctl._dispatch(b"r2", "heartbeat", {"role": "rollout", "index": 2, "stats": {
        "prompt_position": {"2": {"low": 1, "above": []}}, "running": 1, "draining": True}})
    await asyncio.sleep(0.3)
    assert not ctl.launcher.killed  # rollout2 still finishes a group
    await ctl._dispatch(b"r2", "group_done", {"accepted": True, "reason": "accepted", "n_traj": 4})
    await ctl._dispatch(b"r2", "group_done", {"accepted": True, "reason": "accepted", "n_traj": 4})
    await ctl._dispatch(b"r2", "heartbeat", {"role": "rollout", "index": 2, "stats": {
        "prompt_position": {"2": {"low": 2, "above": []}}, "running": 0, "draining": True}})
    await settle(ctl)
    assert scaled(ctl)[-1]["ok"] and sorted(ctl.launcher.killed) == ["rollout1", "rollout2"]
    assert ctl.sup.rollouts() == [0] and not ctl.launcher.dead() and ctl.reporter.lost_groups == 0
    assert ctl.reporter.accepted_groups == 2 and ctl.admission.held[2] == 0
    adopted = [p["streams"] for i, p in sent(ctl, "adopt_streams") if i == b"r0"]
    assert adopted == [{"1": 4}, {"2": {"low": 2, "above": []}}]
    assert ctl.roster.streams_of(0) == [0, 1, 2]
    assert "streams [1, 2] to rollout0" in scaled(ctl)[-1]["message"]
    # a restart of rollout0 continues all three streams; a learner rollback rewinds all three
    await ctl._dispatch(b"r0", "heartbeat", {"role": "rollout", "index": 0, "stats": {"prompt_position": {
        "0": 5, "1": 4, "2": {"low": 2, "above": []}}}})
    assert ctl.roster.prompt_position("rollout", 0) == {"0": 5, "1": 4, "2": {"low": 2, "above": []}}


@pytest.mark.asyncio
async def test_what_the_launcher_cannot_place_is_refused_and_an_added_role_that_never_registers_is_given_up(run):
    ctl, key = run
    await register_all(ctl)
    ctl.launcher.unfit = "launcher=ray: role rollout1 needs 8 CPU on one node, and no node has 8 CPU"
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"rollout": 1}})
    assert not scaled(ctl)[-1]["ok"] and "no node has 8 CPU" in scaled(ctl)[-1]["message"]
    assert ctl.sup.rollouts() == [0] and ctl.launcher.spawns[-1] == "rollout0"  # untouched
    ctl.launcher.unfit = ""
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"rollout": 1, "inference": 1}})
    await settle(ctl)
    assert scaled(ctl)[-1]["ok"] and ctl.sup.joining == {"rollout1", "inference2"}
    for name in ("rollout1", "inference2"):  # placed nowhere (Ray waits for a node): past startup_timeout
        ctl.sup.restarted_at[name] -= ctl.sup.startup_timeout + 1
    assert await ctl.health.check()  # the run goes on without them
    assert ctl.sup.rollouts() == [0] and 1 in ctl.admission.leaving and 2 in ctl.weights.lost
    assert sorted(ctl.launcher.killed) == ["inference2", "rollout1"] and not ctl.sup.joining
    faults = [r for r in map(json.loads, open(os.path.join(ctl.run_dir, "metrics.jsonl")))
              if r.get("kind") == "scale_failed"]
    assert sorted(f["role"] for f in faults) == ["inference2", "rollout1"]
    assert "start (added by arl.ctl scale)" in faults[0]["reason"]


@pytest.mark.asyncio
async def test_an_env_server_joins_and_one_drains(tmp_path):
    ctl = make_controller(tmp_path, num_inference=1, num_rollout=1, num_env=1)
    ctl.launcher.elastic = True
    key = write_control_file(str(tmp_path), "tcp://127.0.0.1:1", signed=False)
    ctl._handlers.update(Scaling(ctl, key=key, env_drain_timeout_s=2.0).handlers)
    for ident, reg in ((b"i0", {"role": "inference", "index": 0, "address": "tcp://a:0"}),
                       (b"e0", {"role": "env", "index": 0, "address": "tcp://e:0"}),
                       (b"L", {"role": "learner", "index": 0}), (b"r0", {"role": "rollout", "index": 0})):
        await ctl._dispatch(ident, "register", reg)
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"env": -1}})  # the only one: refused
    assert not scaled(ctl)[-1]["ok"] and "at least one" in scaled(ctl)[-1]["message"]
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"env": 1}})
    await settle(ctl)
    assert scaled(ctl)[-1]["ok"] and ctl.launcher.spawns[-1] == "env1" and ctl.sup.num_env == 2
    await ctl._dispatch(b"e1", "register", {"role": "env", "index": 1, "address": "tcp://e:1"})
    assert sent(ctl, "worker_back")[-1] == (b"r0", {"role": "env", "index": 1, "address": "tcp://e:1"})
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"env": -1}})  # the newest goes
    await asyncio.sleep(0.05)
    assert sent(ctl, "worker_draining")[-1] == (b"r0", {"role": "env", "index": 1}) and not ctl.launcher.killed
    await ctl._dispatch(b"e1", "heartbeat", {"role": "env", "index": 1, "stats": {"sessions": 2}})
    await asyncio.sleep(0.3)
    assert not ctl.launcher.killed  # its sessions still run
    await ctl._dispatch(b"e1", "heartbeat", {"role": "env", "index": 1, "stats": {"sessions": 0}})
    await settle(ctl)
    assert scaled(ctl)[-1]["ok"] and ctl.launcher.killed == ["env1"] and not ctl.launcher.dead()
    assert sent(ctl, "worker_lost")[-1] == (b"r0", {"role": "env", "indices": [1]})
    assert ctl.roster.addresses["retired_env"] == [1] and "env servers now: [0]" in scaled(ctl)[-1]["message"]
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_env_servers_cannot_be_scaled_in_a_run_without_them(run):
    ctl, key = run
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"env": 1}})
    assert not scaled(ctl)[-1]["ok"] and "env.servers=N" in scaled(ctl)[-1]["message"]


@pytest.mark.asyncio
async def test_a_server_joining_with_another_model_is_refused_named_and_the_run_goes_on(tmp_path):
    run_fp = {"config": "c0", "model": "m0"}
    ctl = make_controller(tmp_path, num_inference=1, num_rollout=1, fingerprint=run_fp)
    ctl.launcher.elastic = True
    key = write_control_file(str(tmp_path), "tcp://127.0.0.1:1", signed=False)
    ctl._handlers.update(Scaling(ctl, key=key).handlers)
    for ident, reg in ((b"i0", {"role": "inference", "index": 0, "address": "tcp://a:0", "fingerprint": run_fp}),
                       (b"L", {"role": "learner", "index": 0, "address": "tcp://l:0", "fingerprint": run_fp}),
                       (b"r0", {"role": "rollout", "index": 0, "fingerprint": run_fp})):
        await ctl._dispatch(ident, "register", reg)
    await ctl._dispatch(b"ctl", "scale", {"token": key, "changes": {"inference": 1, "rollout": 1}})
    await settle(ctl)
    assert scaled(ctl)[-1]["ok"] and ctl.sup.joining == {"inference1", "rollout1"}
    # its node holds another model under model.path: refused, and told why (it exits naming it)
    await ctl._dispatch(b"i1", "register", {"role": "inference", "index": 1, "address": "tcp://a:1",
                                            "fingerprint": {"config": "c0", "model": "m9"}})
    refusal = sent(ctl, "ack")[-1]
    assert refusal[0] == b"i1" and refusal[1]["ok"] is False and "the model it loaded" in refusal[1]["message"]
    assert ("inference", 1) not in ctl.peers and ctl.control_errors["not_this_run"] == 1
    ctl.launcher.exit("inference1", 1)
    await ctl._dispatch(b"r1", "register", {"role": "rollout", "index": 1, "fingerprint": run_fp})  # the same: in
    assert await ctl.health.check()  # given up, not a failure of the run
    assert 1 in ctl.weights.lost and 1 not in ctl.weights.rejoining and ctl.sup.retired["inference"] == {1}
    assert ctl.roster.complete() and ctl.roster.addresses["retired"] == [1]  # lookups do not wait for it
    assert ctl.sup.rollouts() == [0, 1] and not ctl.sup.joining
    faults = [r for r in map(json.loads, open(os.path.join(ctl.run_dir, "metrics.jsonl")))
              if r.get("kind") == "scale_failed"]
    assert [f["role"] for f in faults] == ["inference1"] and "before it registered" in faults[0]["reason"]
    ctl.reporter.close()
