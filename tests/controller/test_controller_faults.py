"""The controller shell on faults, without sockets or processes: who may talk to it, what a dead, silent or
erroring role leads to, and what reaches the roles and metrics.jsonl."""

from __future__ import annotations

import inspect
import json
import re
import time

import pytest

from arl.api.staleness import StalenessPolicy
from arl.controller.shell import Controller
from arl.controller.supervision import Supervisor

from .fakes import FakeLauncher, FakeRouter


def make_controller(tmp_path, **kw) -> Controller:
    """A controller with a small run's settings; `kw` replaces some (the supervisor's go to the Supervisor)."""
    supervision = dict(num_inference=1, num_rollout=2, startup_timeout=60)
    supervision.update({k: kw.pop(k) for k in list(kw) if k in inspect.signature(Supervisor).parameters})
    args = dict(run_dir=str(tmp_path), supervisor=Supervisor(**supervision), batch_size=2, staleness=StalenessPolicy(3),
                max_concurrent_rollouts=8, total_train_steps=4, eval_every=0, eval_max_prompts=4, progress=False,
                launcher=FakeLauncher())
    args.update(kw)
    ctl = Controller(**args)
    ctl.router = FakeRouter()
    ctl.spawn_roles()
    return ctl


def records(tmp_path) -> list[dict]:
    with open(tmp_path / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.asyncio
async def test_only_registered_peers_are_heard(tmp_path):
    ctl = make_controller(tmp_path)
    await ctl._dispatch(b"x", "error", {"message": "stop the run"})
    await ctl._dispatch(b"x", "group_done", {"accepted": True, "reason": "accepted"})
    await ctl._dispatch(b"x", "register", {"role": "rollout", "index": 7})  # no such worker
    await ctl._dispatch(b"x", "register", {"role": "wizard", "index": 0})
    await ctl._dispatch(b"x", "register", {"role": "inference", "index": 0})  # no address
    assert ctl._failure is None and ctl.gate.running == 0 and ctl.peers == {}
    assert ctl.control_errors == {"unknown_peer": 2, "bad_register": 3}
    # a registered peer's malformed payloads are counted, never acted on
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl._dispatch(b"r0", "gate_acquire", {"want": "3"})
    await ctl._dispatch(b"r0", "heartbeat", {"role": "wizard", "index": 0})
    await ctl._dispatch(b"r0", "group_done", {"accepted": True})  # holds no group
    assert ctl.control_errors == {"unknown_peer": 2, "bad_register": 3, "bad_payload": 2,
                                  "unexpected_group_done": 1}
    assert ctl.sup.last_seen.keys() == {("rollout", 0)}
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_dead_rollout_worker_is_restarted_and_its_groups_released(tmp_path):
    ctl = make_controller(tmp_path, max_restarts=1)
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl._dispatch(b"r1", "register", {"role": "rollout", "index": 1})
    await ctl.grant(ctl.admission.open())
    await ctl._dispatch(b"r0", "gate_acquire", {"want": 3})
    await ctl._dispatch(b"r1", "gate_acquire", {"want": 3})
    assert ctl.gate.running == 6 and ctl.admission.held == {0: 3, 1: 3}
    assert [s for s in ctl.router.sent if s[1] == "gate_grant"] == [(b"r0", "gate_grant", {"n": 3}),
                                                                    (b"r1", "gate_grant", {"n": 3})]
    await ctl._dispatch(b"r1", "group_done", {"accepted": True, "reason": "accepted", "n_traj": 4})
    await ctl._dispatch(b"r1", "group_done", {"accepted": False, "reason": "filtered", "n_traj": 0})
    assert ctl.admission.held[1] == 1 and ctl.reporter.accepted_groups == 1
    assert ctl.reporter.accepted_trajectories == 4
    # rollout1 dies holding one group: released (budget back), counted as lost, and the process respawned
    await ctl._dispatch(b"r1", "heartbeat", {"role": "rollout", "index": 1,
                                             "stats": {"prompt_position": 7, "env": {"env_timeout": 2}}})
    ctl.launcher.exit("rollout1", -9)
    assert await ctl.health.check()
    assert ctl.gate.running == 3 and ctl.reporter.lost_groups == 1
    assert ctl.reporter.group_reasons["lost_worker_died"] == 1
    assert ("rollout", 1) not in ctl.peers and 1 not in ctl.admission.held and ctl.sup.restarts == 1
    assert ctl.launcher.alive("rollout1") and ctl.launcher.spawns.count("rollout1") == 2
    # a late message from the dead incarnation is not counted twice
    await ctl._dispatch(b"r1", "group_done", {"accepted": True, "reason": "accepted", "n_traj": 4})
    assert ctl.gate.running == 3 and ctl.control_errors["unknown_peer"] == 1
    # a process that fails before registering is not restarted (a restart would fail the same way) ...
    assert not await ctl.health.on_failure("rollout1", "died while starting")
    # ... and once it registered, one more failure is over the cap: not restarted (the caller stops the run)
    await ctl._dispatch(b"r1b", "register", {"role": "rollout", "index": 1})
    assert ctl.router.sent[-1] == (b"r1b", "ack", {"ok": True, "prompt_position": {"1": 7}})
    assert ctl.accounting()["env"] == {"env_timeout": 2}  # the dead incarnation's counts are kept
    assert not await ctl.health.on_failure("rollout1", "again") and ctl.sup.restarts == 1
    recs = records(tmp_path)
    assert [r["type"] for r in recs] == ["worker_restarted"] and recs[0]["lost_groups"] == 1
    assert recs[0]["reason"] == "exited with code -9"
    acct = ctl.accounting()
    assert acct["lost_in_flight_groups"] == 1 and acct["rollout_restarts"] == 1
    # the learner exiting is fatal
    ctl.launcher.exit("learner", 1)
    assert not await ctl.health.check() and ctl._failure.startswith("role learner exited with code 1")
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_silent_rollout_worker_is_investigated_then_restarted(tmp_path):
    ctl = make_controller(tmp_path, heartbeat_timeouts={"rollout": 5.0})
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl._dispatch(b"r0", "heartbeat", {"role": "rollout", "index": 0, "stats": {"waiting_on": "env step"}})
    ctl.sup.last_seen[("rollout", 0)] = time.monotonic() - 10
    assert await ctl.health.check()
    assert ctl.launcher.spawns.count("rollout0") == 2 and ctl.sup.restarts == 1
    fault, restart = records(tmp_path)
    assert fault["type"] == "fault" and fault["kind"] == "heartbeat_timeout" and fault["waiting_on"] == "env step"
    assert fault["stacks_dumped"] and fault["process_state"] == "T"
    assert restart["type"] == "worker_restarted" and "sent no heartbeat for 10s" in restart["reason"]
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_inference_restart_rejoins_only_with_the_newest_weights(tmp_path):
    ctl = make_controller(tmp_path, num_inference=2, num_rollout=1, total_train_steps=10,
                          tolerate_inference_loss=True, restart_inference=True, max_inference_restarts=2)
    for i in (0, 1):
        await ctl._dispatch(f"i{i}".encode(), "register", {"role": "inference", "index": i, "address": f"tcp://a:{i}"})
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0, "address": "tcp://l:1"})
    assert ctl.router.sent[-1] == (b"r0", "eval", {"version": 0, "max_prompts": 4})  # all registered
    sent = ctl.router.sent

    def last():  # the newest message to a role other than the learner's prune_weights
        return [s for s in sent if s[1] != "prune_weights"][-1]

    await ctl._dispatch(b"L", "weights_published", {"version": 3, "path": "/w/v3"})
    assert sent[-2:] == [(b"i0", "update_weights", {"version": 3, "path": "/w/v3"}),
                         (b"i1", "update_weights", {"version": 3, "path": "/w/v3"})]
    ctl.launcher.exit("inference1", -9)
    assert await ctl.health.check()
    assert ctl.weights.lost == {1} and ctl.weights.rejoining == {1} and ctl.sup.inference_restarts == 1
    assert ctl.launcher.alive("inference1")  # respawned
    assert (b"r0", "worker_lost", {"role": "inference", "indices": [1]}) in sent
    # it registers at a new address: told to load the newest version; still out of the routing
    await ctl._dispatch(b"i1b", "register", {"role": "inference", "index": 1, "address": "tcp://b:1"})
    assert sent[-1] == (b"i1b", "update_weights", {"version": 3, "path": "/w/v3"})
    await ctl._dispatch(b"i1", "weights_loaded", {"version": 3, "index": 1})  # the dead incarnation
    assert ctl.control_errors == {"unknown_peer": 1} and ctl.weights.acked[1] == 0
    # v4 comes out while both load v3: nothing is sent now (one load in flight per server) ...
    n = len(sent)
    await ctl._dispatch(b"L", "weights_published", {"version": 4, "path": "/w/v4"})
    assert [s for s in sent[n:] if s[1] == "update_weights"] == []
    # ... each gets v4 once it acked v3; v3 is live on the ack set (server 0) meanwhile
    await ctl._dispatch(b"i0", "weights_loaded", {"version": 3, "index": 0})
    assert last() == (b"i0", "update_weights", {"version": 4, "path": "/w/v4"}) and ctl.gate.version == 3
    assert sent[-1] == (b"L", "prune_weights", {"below": 3})  # v3 is needed: the restarted server still loads it
    await ctl._dispatch(b"i1b", "weights_loaded", {"version": 3, "index": 1})
    assert sent[-1] == (b"i1b", "update_weights", {"version": 4, "path": "/w/v4"}) and 1 in ctl.weights.lost
    await ctl._dispatch(b"i1b", "weights_loaded", {"version": 4, "index": 1})
    assert ctl.weights.lost == set() and ctl.weights.rejoining == set()
    assert last() == (b"r0", "worker_back", {"role": "inference", "index": 1, "address": "tcp://b:1"})
    await ctl._dispatch(b"i0", "weights_loaded", {"version": 4, "index": 0})
    assert ctl.gate.version == 4
    # it dies again after rejoining: lost and restarted again (cap 2); then the cap holds
    ctl.launcher.exit("inference1", -9)
    assert await ctl.health.check() and ctl.sup.inference_restarts == 2
    ctl.launcher.exit("inference1", -9)  # the restart dies before it registered: lost again, over the cap
    assert await ctl.health.check()
    assert ctl.sup.inference_restarts == 2 and not ctl.launcher.alive("inference1") and ctl.weights.lost == {1}
    kinds = [r["type"] for r in records(tmp_path) if r["type"] != "train"]
    assert kinds == ["worker_lost", "worker_restarted", "worker_back", "worker_lost", "worker_restarted",
                     "worker_lost"]
    assert ctl.accounting()["inference_restarts"] == 2
    # the last server going is fatal
    ctl.launcher.exit("inference0", -9)
    assert not await ctl.health.check() and "inference0 exited" in ctl._failure
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_restarted_inference_that_never_registers_is_given_up(tmp_path):
    ctl = make_controller(tmp_path, num_inference=2, num_rollout=1, tolerate_inference_loss=True,
                          restart_inference=True, startup_timeout=30, max_learner_restarts=0)
    for i in (0, 1):
        await ctl._dispatch(f"i{i}".encode(), "register", {"role": "inference", "index": i, "address": f"tcp://a:{i}"})
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0, "address": "tcp://l:1"})
    await ctl._dispatch(b"i1", "error", {"message": "update_weights failed: disk full"})
    assert ctl.weights.lost == {1} and ctl.weights.rejoining == {1} and ctl._failure is None
    ctl.sup.restarted_at["inference1"] -= 31
    assert await ctl.health.check()
    assert ctl.weights.rejoining == set() and ctl.weights.lost == {1} and ctl.launcher.killed[-1] == "inference1"
    assert records(tmp_path)[-1]["kind"] == "inference_restart_failed"
    # a role that reports a fatal error it cannot be restarted for stops the run
    await ctl._dispatch(b"L", "error", {"message": "CUDA OOM"})
    assert ctl._failure == "role reported a fatal error: CUDA OOM"
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_a_last_inference_server_whose_restart_waits_to_be_placed_stops_the_run_with_why(tmp_path):
    """The only inference server's node was lost and its restart cannot be placed (the launcher says why: `pending`).
    Past startup_timeout the run stops at once with that reason, instead of going on with no server until the
    no-progress watch gives up minutes later; a late restarted rollout worker's failure carries its reason too."""
    ctl = make_controller(tmp_path, num_inference=1, num_rollout=1, tolerate_inference_loss=True,
                          restart_inference=True, startup_timeout=30)
    await ctl._dispatch(b"i0", "register", {"role": "inference", "index": 0, "address": "tcp://a:0"})
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0, "address": "tcp://l:1"})
    ctl.launcher.exit("inference0", -9)
    assert await ctl.health.check() and ctl.sup.inference_restarts == 1 and ctl.weights.rejoining == {0}
    why = "inference0 is waiting to be placed: it asks 3 CPU on one node; Ray says INFEASIBLE"
    ctl.launcher.waiting["inference0"] = why
    ctl.sup.restarted_at["inference0"] -= 31
    assert not await ctl.health.check()
    assert "no inference server is left" in ctl._failure and why in ctl._failure, ctl._failure
    assert why in records(tmp_path)[-1]["reason"] and records(tmp_path)[-1]["kind"] == "inference_restart_failed"
    ctl.reporter.close()

    (tmp_path / "b").mkdir()
    ctl = make_controller(tmp_path / "b", num_rollout=1, startup_timeout=30)
    await ctl._dispatch(b"i0", "register", {"role": "inference", "index": 0, "address": "tcp://a:0"})
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0, "address": "tcp://l:1"})
    ctl.launcher.exit("rollout0", -9)
    assert await ctl.health.check() and ctl.sup.restarts == 1
    ctl.launcher.waiting["rollout0"] = "rollout0 is waiting to be placed: it asks 2 CPU"
    ctl.sup.restarted_at["rollout0"] -= 31
    assert not await ctl.health.check()
    assert "['rollout0']" in ctl._failure and "it asks 2 CPU" in ctl._failure, ctl._failure
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_every_group_dropped_for_one_reason_stops_the_run(tmp_path, capsys):
    ctl = make_controller(tmp_path, max_consecutive_drops=3, progress=True)
    for r in (0, 1):
        await ctl._dispatch(f"r{r}".encode(), "register", {"role": "rollout", "index": r})
    await ctl.grant(ctl.admission.open())
    await ctl._dispatch(b"r0", "gate_acquire", {"want": 4})
    for _ in range(2):
        await ctl._dispatch(b"r0", "group_done", {"accepted": False, "reason": "reward_error"})
    assert await ctl.health.check()
    assert "reward_error 2" in capsys.readouterr().err  # the progress line shows the drops by reason
    await ctl._dispatch(b"r0", "group_done", {"accepted": False, "reason": "reward_error"})
    assert not await ctl.health.check()
    assert "no progress" in ctl._failure and "dropped for 'reward_error'" in ctl._failure
    assert [r for r in records(tmp_path) if r["type"] == "no_progress"][0]["drops"] == {"reward_error": 3}
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_a_failed_weight_load_is_retried_and_the_lone_server_goes_on(tmp_path):
    """One inference server whose load of v1 fails once: the controller sends it again (the newest), the server
    acks the retry and v1 goes live; a server that keeps failing is handled as a failed server (here: the run stops
    and says why)."""
    ctl = make_controller(tmp_path, num_inference=1, num_rollout=1, total_train_steps=10)
    await ctl._dispatch(b"i0", "register", {"role": "inference", "index": 0, "address": "tcp://a:0"})
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0, "address": "tcp://l:1"})
    sent = ctl.router.sent
    await ctl._dispatch(b"L", "weights_published", {"version": 1, "path": "/w/v1"})
    assert sent[-1] == (b"i0", "update_weights", {"version": 1, "path": "/w/v1"})
    n = len(sent)
    await ctl._dispatch(b"i0", "weights_loaded", {"version": 1, "index": 0, "error": "OSError: disk read"})
    assert sent[n:] == [(b"i0", "update_weights", {"version": 1, "path": "/w/v1"})] and ctl._failure is None
    fault = [r for r in records(tmp_path) if r["type"] == "fault"][-1]
    assert fault["kind"] == "weight_load_failed" and fault["error"] == "OSError: disk read" and fault["server"] == 0
    await ctl._dispatch(b"i0", "weights_loaded", {"version": 1, "index": 0})
    assert ctl.gate.version == 1 and ctl._failure is None
    await ctl._dispatch(b"L", "weights_published", {"version": 2, "path": "/w/v2"})
    for _ in range(3):
        await ctl._dispatch(b"i0", "weights_loaded", {"version": 2, "index": 0, "error": "OSError: gone"})
    assert ctl._failure is not None and "could not load weights v2" in ctl._failure and "OSError: gone" in ctl._failure
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_a_stall_with_no_drops_stops_the_run_and_says_what_is_stuck(tmp_path):
    """Groups granted and never reported done (leaked slots, a lost push), no drop, no step: after
    max_no_progress_s the run stops, naming the groups in flight per rollout worker (the controller's count and the
    worker's own), the learner's buffer and when each role last sent what."""
    ctl = make_controller(tmp_path, num_rollout=2, max_no_progress_s=300, max_consecutive_drops=5)
    await ctl._dispatch(b"i0", "register", {"role": "inference", "index": 0, "address": "tcp://a:0"})
    for r in (0, 1):
        await ctl._dispatch(f"r{r}".encode(), "register", {"role": "rollout", "index": r})
    await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0, "address": "tcp://l:1"})
    await ctl._dispatch(b"r0", "eval_done", {"version": 0, "n": 1, "first_acc": 0.0, "solved_acc": 0.0})  # opens
    await ctl._dispatch(b"r0", "gate_acquire", {"want": 3})
    await ctl._dispatch(b"r0", "heartbeat", {"role": "rollout", "index": 0,
                                             "stats": {"running": 0, "wanted": 0, "waiting_on": "0 groups running"}})
    await ctl._dispatch(b"L", "heartbeat", {"role": "learner", "index": 0, "stats": {
        "version": 0, "buffered_groups": 1, "buffered_trajectories": 4, "in_step_groups": 0, "groups_received": 1,
        "trained_groups": 0, "waiting_on": "waiting for a batch (1/2 groups buffered)"}})
    now = time.monotonic()
    assert ctl.health.progressing(now) and ctl.health.progressing(now + 299)
    assert not ctl.health.progressing(now + 301)
    failure = ctl._failure
    assert "no prompt group accepted and no learner step for 301s, and no group dropped either" in failure
    assert "rollout0: 3 groups in flight (its own count: 0 running, 0 awaiting a grant)" in failure
    assert "rollout1: 0 groups in flight (no heartbeat yet); last messages: register " in failure
    assert "learner: version 0, 1 groups buffered (4 trajectories), 0 in a step, 1 received, 0 trained" in failure
    assert "waiting for a batch (1/2 groups buffered)" in failure
    assert re.search(r"rollout0: .*; last messages: heartbeat 3\d\ds ago, gate_acquire 3\d\ds ago, eval_done "
                     r"3\d\ds ago, register 3\d\ds ago", failure)
    assert "inference0: server 0 at version ?" in failure
    assert [r for r in records(tmp_path) if r["type"] == "no_progress"][0]["reason"] in failure
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_a_drop_streak_stop_says_the_newest_error(tmp_path):
    ctl = make_controller(tmp_path, max_consecutive_drops=2)
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl.grant(ctl.admission.open())
    await ctl._dispatch(b"r0", "gate_acquire", {"want": 4})
    for msg in ("first", "the reward service is down"):
        await ctl._dispatch(b"r0", "group_done", {
            "accepted": False, "reason": "env_error:step:ValueError",
            "error": f"RaisingEnv.step raised ValueError: {msg}\nraised at (innermost last):\n"
                     f'  File "bad_env.py", line 9, in step\n    raise ValueError("{msg}")'})
    assert not await ctl.health.check()
    assert ctl._failure.endswith("its newest error:\nRaisingEnv.step raised ValueError: the reward service is down\n"
                                 'raised at (innermost last):\n  File "bad_env.py", line 9, in step\n'
                                 '    raise ValueError("the reward service is down")')


@pytest.mark.asyncio
async def test_a_group_the_learner_has_is_accepted_though_its_worker_died_before_group_done(tmp_path):
    """Rollout worker 0 pushes two groups and dies before either group_done: the learner's receipts settle them
    as accepted (one before the death is noticed, one after), not lost with their budget given back."""
    ctl = make_controller(tmp_path, num_rollout=1, max_restarts=1)
    await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0})
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl.grant(ctl.admission.open())
    await ctl._dispatch(b"r0", "gate_acquire", {"want": 3, "incarnation": "aa"})
    assert ctl.gate.running == 3
    await ctl._dispatch(b"L", "group_received", {"group_id": "w0.aag0", "n_traj": 4})
    assert ctl.gate.accepted == 1 and ctl.gate.running == 2
    ctl.launcher.exit("rollout0", -9)
    assert await ctl.health.check()
    assert ctl.reporter.accepted_groups == 1 and ctl.reporter.accepted_trajectories == 4
    assert ctl.reporter.lost_groups == 2 and ctl.gate.accepted == 1 and ctl.gate.running == 0
    await ctl._dispatch(b"L", "group_received", {"group_id": "w0.aag1", "n_traj": 4})  # after the death
    assert ctl.reporter.accepted_groups == 2 and ctl.reporter.lost_groups == 1 and ctl.gate.accepted == 2
    assert ctl.reporter.group_reasons["lost_worker_died"] == 1
    # a receipt for a group no worker holds gives nothing, and only the learner may send one
    await ctl._dispatch(b"L", "group_received", {"group_id": "w0.bbg0", "n_traj": 4})  # another process's
    await ctl._dispatch(b"L", "group_received", {"group_id": "nonsense", "n_traj": 4})
    await ctl._dispatch(b"L", "group_received", {"group_id": "w0.aag1", "n_traj": 4})  # a duplicate receipt
    assert ctl.gate.accepted == 2 and ctl.control_errors == {"unknown_group": 2}
    assert ctl.reporter.accepted_groups == 2
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_a_learner_drop_that_overtakes_its_group_done_returns_the_budget(tmp_path):
    ctl = make_controller(tmp_path, num_rollout=1, batch_size=1, staleness=StalenessPolicy(0))
    await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0})
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl.grant(ctl.admission.open())
    await ctl._dispatch(b"r0", "gate_acquire", {"want": 2, "incarnation": "aa"})
    assert ctl.gate.running == 1  # batch 1, eta 0: one group at version 0
    # the learner refuses the group (invalid) before the rollout worker's group_done reaches the controller
    await ctl._dispatch(b"L", "groups_dropped", {"n": 1, "reason": "invalid", "group_ids": ["w0.aag0"]})
    await ctl._dispatch(b"r0", "group_done", {"accepted": True, "reason": "accepted", "n_traj": 2,
                                              "group_id": "w0.aag0"})
    assert ctl.gate.accepted == 0 and ctl.gate.running == 1  # its budget came back: the next group started
    assert [s for s in ctl.router.sent if s[1] == "gate_grant"][-1] == (b"r0", "gate_grant", {"n": 1})
    assert ctl.reporter.group_reasons["dropped_invalid"] == 1 and ctl.control_errors == {}
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_a_lost_learner_is_restarted_and_the_run_rolls_back_to_its_checkpoint(tmp_path):
    ctl = make_controller(tmp_path, num_inference=2, num_rollout=2, total_train_steps=6, max_learner_restarts=1)
    for i in (0, 1):
        await ctl._dispatch(f"i{i}".encode(), "register", {"role": "inference", "index": i, "address": f"tcp://a:{i}"})
        await ctl._dispatch(f"r{i}".encode(), "register", {"role": "rollout", "index": i})
    await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0, "address": "tcp://l:1"})
    await ctl._dispatch(b"r0", "eval_done", {"version": 0, "n": 1, "first_acc": 0.0, "solved_acc": 0.0})
    await ctl._dispatch(b"r0", "gate_acquire", {"want": 8, "incarnation": "aa"})
    assert ctl.gate.running == 8  # (0 + 3 + 1) * 2
    for n in range(6):  # pushed and reported; the learner trains 2 steps, checkpoints v1, publishes v2
        await ctl._dispatch(b"r0", "group_done", {"accepted": True, "reason": "accepted", "n_traj": 4,
                                                  "group_id": f"w0.aag{n}"})
    await ctl._dispatch(b"L", "weights_published", {"version": 2, "path": "/w/v2"})
    for i in (0, 1):
        await ctl._dispatch(f"i{i}".encode(), "weights_loaded", {"version": 2, "index": i})
    assert ctl.gate.version == 2 and ctl.admission.is_open
    sent = ctl.router.sent
    n = len(sent)
    ctl.launcher.exit("learner", -9)
    assert await ctl.health.check() and ctl._failure is None
    assert ctl.launcher.spawns.count("learner") == 2 and ctl.launcher.env["ARL_LEARNER_RESTART"] == "1"
    assert sorted(sent[n:]) == [(b"r0", "worker_lost", {"role": "learner", "indices": [0]}),
                                (b"r1", "worker_lost", {"role": "learner", "indices": [0]})]
    await ctl._dispatch(b"r0", "group_done", {"accepted": True, "reason": "accepted", "n_traj": 4,
                                              "group_id": "w0.aag6"})
    await ctl._dispatch(b"r1", "gate_acquire", {"want": 4, "incarnation": "bb"})
    assert [s for s in sent[n:] if s[1] == "gate_grant"] == []  # paused while the learner is away
    # the new learner resumed from checkpoint v1: 2 groups consumed, 3 received (one was buffered, lost with it)
    n = len(sent)
    await ctl._dispatch(b"L2", "register", {"role": "learner", "index": 0, "address": "tcp://l:2", "resumed": {
        "version": 1, "groups_consumed": 2, "data_position": {"0": 5}, "groups_settled": 2,
        "trajectories_settled": 8}})
    out = [s for s in sent[n:] if s[1] != "ack"]
    v1 = str(tmp_path / "weights" / "v1.safetensors")  # exported by the new learner, as on a recover=auto resume
    assert out == [(b"r0", "learner_restarted", {"address": "tcp://l:2", "version": 1, "position": {"0": 5}}),
                   (b"r1", "learner_restarted", {"address": "tcp://l:2", "version": 1,
                                                           "position": {"1": {"low": 0, "above": []}}}),
                   (b"i0", "update_weights", {"version": 1, "path": v1, "rollback": True}),
                   (b"i1", "update_weights", {"version": 1, "path": v1, "rollback": True})]
    assert ctl.roster.addresses["learner"] == "tcp://l:2" and ctl.roster.positions[0] == 5
    assert (ctl.gate.version, ctl.gate.accepted, ctl.gate.running) == (1, 2, 1) and not ctl.admission.is_open
    fault = [{k: r[k] for k in ("type", "reason", "from_version", "to_version", "restarts", "lost_groups")}
             for r in records(tmp_path) if r.get("kind") == "learner_restart"]
    # 7 accepted (one pushed to the dead learner before its worker heard), 2 in the checkpoint: 5 lost with it
    assert fault == [{"type": "fault", "reason": "exited with code -9", "from_version": 2, "to_version": 1,
                      "restarts": 1, "lost_groups": 5}]
    # a running group holding tokens of the lost v2 is dropped: its budget comes back once admission reopens
    await ctl._dispatch(b"r0", "group_done", {"accepted": False, "reason": "lost_version", "group_id": "w0.aag7"})
    await ctl._dispatch(b"i0", "weights_loaded", {"version": 2, "index": 0})  # a late ack of the lost v2
    await ctl._dispatch(b"i0", "weights_loaded", {"version": 1, "index": 0})
    assert not ctl.admission.is_open
    n = len(sent)
    await ctl._dispatch(b"i1", "weights_loaded", {"version": 1, "index": 1})
    assert ctl.admission.is_open and ctl.gate.version == 1 and (b"r1", "gate_grant", {"n": 4}) in sent[n:]
    acct = ctl.accounting()
    assert acct["learner_restarts"] == 1 and acct["accepted_groups"] == 2
    assert acct["groups"]["lost_learner_restart"] == 5 and acct["groups"]["lost_version"] == 1
    # it dies again: over the cap, the run stops
    ctl.launcher.exit("learner", -9)
    assert not await ctl.health.check() and "role learner exited with code -9" in ctl._failure
    ctl.reporter.close()
