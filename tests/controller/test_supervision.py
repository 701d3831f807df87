"""Supervisor: restart policy, heartbeat and registration deadlines; LocalLauncher over real processes."""

from __future__ import annotations

import sys

import pytest

from arl.launch.local import LocalLauncher
from arl.controller.supervision import RoleLauncher, Supervisor


def make(**kw) -> Supervisor:
    args = dict(num_inference=4, num_rollout=2, servers_per_process=2, startup_timeout=30.0,
                heartbeat_timeouts={"inference": 10.0, "learner": 60.0, "rollout": 5.0})
    args.update(kw)
    return Supervisor(**args)


def register_all(s: Supervisor) -> None:
    keys = [("inference", i) for i in range(s.num_inference)] + [("learner", 0)]
    keys += [("rollout", i) for i in range(s.num_rollout)]
    for n, k in enumerate(keys, 1):
        s.registered(k, 0.0, n)


def test_names():
    s = make()
    assert s.process_of("inference", 3) == "inference1" and s.process_of("learner", 0) == "learner"
    assert s.servers_of("inference1") == [2, 3] and s.servers_of("rollout1") == [] and s.servers_of("inferencex") == []
    assert make(num_inference=3).servers_of("inference1") == [2]
    assert s.rollout_index("rollout1") == 1 and s.rollout_index("learner") is None


def test_trainable_policies_learners_are_processes_of_their_own_restarted_under_the_learners_cap():
    """learner1 .. train the trainable listed policies: started with the run, expected to register, parsed back
    from their names; a lost one is restarted (from its own checkpoint) under learner.max_restarts, while the
    run's own learner is not restarted in such a run (its rollback is not built for the others)."""
    from arl.controller.supervision import process_role

    s = make(num_policy_learners=2)
    assert s.expected == make().expected + 2
    names = [n for n, _ in s.commands("python", "/run", "tcp://c:1")]
    assert names[:4] == ["inference0", "inference1", "learner", "learner1"] and "learner2" in names
    argv = dict(s.commands("python", "/run", "tcp://c:1"))["learner2"]
    assert argv[argv.index("--role") + 1] == "learner" and argv[argv.index("--index") + 1] == "2"
    assert s.process_of("learner", 2) == "learner2" and process_role("learner2") == ("learner", 2)
    assert process_role("learner") == ("learner", 0)
    register_all(s)
    assert s.decide("learner1", registered=True, lost=set()).action == "restart_policy_learner"
    d = s.decide("learner", registered=True, lost=set())
    assert d.action == "fatal" and "trainable listed policies" in d.note
    assert s.restarting("learner2", 1.0) == 1 and s.learner_restarts == 1
    assert make(num_policy_learners=1, max_learner_restarts=0).decide("learner1", registered=True,
                                                                     lost=set()).action == "fatal"
    capped = make(num_policy_learners=1, max_learner_restarts=1)
    capped.restarting("learner1", 1.0)
    assert capped.decide("learner1", registered=True, lost=set()).action == "fatal"


def test_rollout_restarts_up_to_the_cap_and_only_once_registered():
    s = make(max_restarts=1)
    assert s.decide("rollout0", registered=False, lost=set()).action == "fatal"
    assert s.decide("rollout0", registered=True, lost=set()).action == "restart_rollout"
    assert s.restarting("rollout0", 1.0) == 1
    d = s.decide("rollout1", registered=True, lost=set())
    assert d.action == "fatal" and "max_restarts" in d.note
    assert make(restart_rollout=False).decide("rollout0", registered=True, lost=set()).action == "fatal"


def test_learner_failure_is_fatal_without_learner_restarts():
    s = make(tolerate_inference_loss=True, max_learner_restarts=0)
    register_all(s)
    assert s.decide("learner", registered=True, lost=set()).action == "fatal"


def test_a_lost_learner_is_restarted_up_to_its_cap_and_only_once_registered():
    s = make(max_learner_restarts=2)
    register_all(s)
    assert s.decide("learner", registered=False, lost=set()).action == "fatal"  # it would fail the same way
    assert s.decide("learner", registered=True, lost=set(), spawned=False).action == "fatal"
    assert s.decide("learner", registered=True, lost=set()).action == "restart_learner"
    assert s.restarting("learner", 1.0) == 1 and s.learner_restarts == 1 and s.restarts == 0
    assert s.restarting("learner", 2.0) == 2
    d = s.decide("learner", registered=True, lost=set())  # the same step keeps failing: no restart loop
    assert d.action == "fatal" and "learner.max_restarts" in d.note


def test_inference_loss_needs_tolerance_a_full_start_and_a_remaining_server():
    s = make(tolerate_inference_loss=True, restart_inference=True, max_inference_restarts=1)
    assert s.decide("inference0", registered=True, lost=set()).action == "fatal"  # not all up yet
    register_all(s)
    d = s.decide("inference0", registered=True, lost=set())
    assert d.action == "lose_inference" and d.restart
    s.restarting("inference0", 1.0)
    d = s.decide("inference0", registered=True, lost={0, 1})
    assert d.action == "lose_inference" and not d.restart  # over the restart cap
    assert s.decide("inference1", registered=True, lost={0, 1}).action == "fatal"  # nothing would remain
    no_tolerance = make()
    register_all(no_tolerance)
    assert no_tolerance.decide("inference0", registered=True, lost=set()).action == "fatal"


def test_a_lone_inference_server_is_restarted_when_restarts_are_on():
    """One inference server: its loss is survivable only by restarting it (generation waits meanwhile)."""
    s = make(num_inference=1, servers_per_process=1, tolerate_inference_loss=True, restart_inference=True,
             max_inference_restarts=1)
    register_all(s)
    d = s.decide("inference0", registered=True, lost=set())
    assert d.action == "lose_inference" and d.restart and d.servers == (0,)
    s.restarting("inference0", 1.0)
    # its restart dies before it rejoined: over the cap now, and no server would remain
    assert s.decide("inference0", registered=True, lost={0}, rejoining={0}).action == "fatal"
    no_restart = make(num_inference=1, servers_per_process=1, tolerate_inference_loss=True)
    register_all(no_restart)
    assert no_restart.decide("inference0", registered=True, lost=set()).action == "fatal"


def test_heartbeat_timeouts_are_per_role():
    s = make()
    s.heard(("rollout", 0), 100.0)
    s.heard(("learner", 0), 100.0)
    assert s.silent(104.0) == []
    assert s.silent(106.0) == [(("rollout", 0), 100.0)]
    s.forget(("rollout", 0))
    assert s.silent(170.0) == [(("learner", 0), 100.0)]


def test_registration_deadlines():
    s = make()
    assert not s.startup_overdue(0.0) and not s.startup_overdue(30.0)
    assert s.startup_overdue(31.0)
    register_all(s)
    assert not s.startup_overdue(100.0)  # once all were up, gaps are restarts
    s.restarting("rollout1", 100.0)
    assert s.late(129.0) == [] and s.late(131.0) == ["rollout1"]
    assert s.registered(("rollout", 1), 131.0, 7) and s.late(200.0) == []
    assert not s.registered(("rollout", 1), 132.0, 7)  # a second registration is no restart
    s.restarting("inference1", 200.0)
    assert s.registered(("inference", 3), 201.0, 7)  # any server of the process counts
    s.restarting("inference0", 300.0)
    s.gave_up("inference0")
    assert s.late(1000.0) == []


def test_deadlines_give_up_on_restarted_inference_and_name_what_never_registered():
    sup = Supervisor(num_inference=2, num_rollout=1, startup_timeout=10)
    up = {"inference0", "learner"}
    names = ["inference0", "inference1", "learner", "rollout0"]
    assert sup.deadlines(0.0, names, up.__contains__) == ([], "")
    assert sup.deadlines(11.0, names, up.__contains__) == (
        [], "roles did not register within 10s: ['inference1', 'rollout0']")
    sup = Supervisor(num_inference=2, num_rollout=1, startup_timeout=10)
    sup.all_up = True
    sup.restarting("inference1", 0.0)
    sup.restarting("rollout0", 5.0)
    assert sup.deadlines(11.0, names, up.__contains__) == (["inference1"], "")  # the run goes on without it
    assert sup.deadlines(16.0, names, up.__contains__) == (
        ["inference1"], "restarted roles did not register within 10s: ['rollout0']")


def test_local_launcher_spawns_kills_and_reports_deaths(tmp_path):
    launcher: RoleLauncher = LocalLauncher()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    try:
        launcher.spawn("a", sleeper, str(tmp_path / "a.log"))
        launcher.spawn("b", [sys.executable, "-c", "raise SystemExit(3)"], str(tmp_path / "b.log"))
        launcher.children["b"].proc.wait()  # type: ignore[attr-defined]
        assert launcher.dead() == [("b", 3)] and launcher.alive("a") and launcher.has("b")
        assert launcher.log_path("a") == str(tmp_path / "a.log")
        with pytest.raises(RuntimeError):  # a running one is not started twice
            launcher.respawn("a")
        launcher.kill("a")
        launcher.children["a"].proc.wait()  # type: ignore[attr-defined]
        launcher.respawn("a")
        assert launcher.alive("a")
        launcher.kill("a")
        launcher.children["a"].proc.wait()  # type: ignore[attr-defined]
        assert not launcher.alive("a") and launcher.dead() == [("b", 3)]  # a killed one is no death
        assert launcher.stack_dump("a", 0.1) == ("?", "")
    finally:
        launcher.terminate_all(1.0)


def test_the_run_s_role_commands_come_from_the_supervisor():
    sup = Supervisor(num_inference=3, num_rollout=2, servers_per_process=2, startup_timeout=10)
    cmds = dict(sup.commands("py", "/run", "tcp://c:1", learner_ranks=2))
    assert list(cmds) == ["inference0", "inference1", "learner", "rollout0", "rollout1"]
    assert cmds["inference1"][-4:] == ["--role", "inference", "--index", "1"]
    assert cmds["learner"][:3] == ["py", "-m", "torch.distributed.run"]  # ranks under torchrun
    assert dict(sup.commands("py", "/run", "tcp://c:1", 2, torchrun=False))["learner"][:3] == ["py", "-m",
                                                                                             "arl.launch.role"]
