"""Reporter: records to every sink, trajectory means, idle fraction, accounting."""

from __future__ import annotations

import json

from arl.controller.diagnosis import stall_report
from arl.controller.reporting import UNIFORM_TEXT, JsonlSink, ProgressWatch, Reporter, format_drops


class ListSink:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []
        self.closed = False

    def log(self, record: dict, step: int) -> None:
        self.logged.append((record, step))

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_records_reach_every_sink_with_their_step(tmp_path):
    sink, clock = ListSink(), Clock()
    path = str(tmp_path / "metrics.jsonl")
    r = Reporter([JsonlSink(path), sink], total_steps=3, clock=clock)
    clock.t = 101.5
    r.group_done(True, "accepted", 4, {"tool_calls": 6.0, "flag": True, "name": "x"}, 4)
    r.group_done(False, "filtered", 0, {"tool_calls": 2.0}, 2)
    r.train(1, {"reward_mean": 0.5}, {})
    r.event("worker_lost", role="inference", servers=[1])
    r.fault("rollout_restart", "worker_restarted", role="rollout0", lost_groups=2)
    r.close()
    assert sink.closed
    (train, s1), (lost, s2), (restart, _) = sink.logged
    assert s1 == 1 and s2 == 1  # an event carries the latest step
    assert train["groups"] == {"accepted": 1, "filtered": 1} and train["reward_mean"] == 0.5
    assert train["rollout"] == {"n_traj": 6, "tool_calls": 8.0 / 6}  # non-numbers are not averaged
    assert train["elapsed"] == 1.5 and lost == {"type": "worker_lost", "elapsed": 1.5, "role": "inference",
                                                  "servers": [1]}
    assert restart["kind"] == "rollout_restart" and r.faults == [{"kind": "rollout_restart", "role": "rollout0",
                                                                  "lost_groups": 2}]
    lines = [json.loads(line) for line in open(path)]
    assert [x["type"] for x in lines] == ["train", "worker_lost", "worker_restarted"] and "time" in lines[0]
    assert r.take_traj_means() == {}  # taken by the train record


def test_inference_idle_fraction_from_busy_seconds():
    r = Reporter([], total_steps=1)
    stats = {("inference", 0): {"busy_s": 1.0, "uptime": 10.0}, ("rollout", 0): {"busy_s": 5.0}}
    assert r.inference_idle_fraction(stats) is None  # needs two samples
    stats[("inference", 0)] = {"busy_s": 4.0, "uptime": 14.0}
    assert r.inference_idle_fraction(stats) == 0.25


def test_eval_records_and_accounting():
    sink = ListSink()
    r = Reporter([sink], total_steps=2)
    line = r.eval_done(2, {"version": 2, "n": 4, "first_acc": 0.5, "solved_acc": 0.75}, {("rollout", 0): {"x": 1}})
    assert r.evals[2]["first_acc"] == 0.5
    assert line.startswith("eval v2: first-answer acc 0.500") and sink.logged[0][0]["roles"] == {"rollout0": {"x": 1}}
    r.group_done(True, "accepted", 3, None, None)
    r.groups_lost(2)
    r.keep_env_counts({"env": {"env_timeout": 1, "env_calls_in_flight": 3}})
    role_stats = {("learner", 0): {"groups_received": 1, "trained_groups": 1, "transport": {"sent": 5}},
                  ("rollout", 0): {"env": {"env_timeout": 2},
                                   "client": {"resent_timeout": 2, "aborted_resent": 2, "aborted_abandoned": 1,
                                              "sent_w0": 9}},
                  ("rollout", 1): {"client": {"resent_timeout": 1, "aborted_resent": 1}},
                  ("inference", 0): {"aborted": 3}}
    acct = r.accounting(role_stats=role_stats, steps=2, running_groups=0, failure=None, rollout_restarts=1,
                        inference_restarts=0, transport={"controller": {}})
    assert acct["finished"] and acct["accepted_groups"] == 1 and acct["lost_in_flight_groups"] == 2
    assert acct["groups"] == {"accepted": 1, "lost_worker_died": 2} and acct["env"] == {"env_timeout": 3}
    assert acct["lost_accepted_groups"] == 0 and acct["learner_balance"] == 0
    assert acct["transport"] == {"controller": {}, "learner0": {"sent": 5}}
    assert acct["requests"] == {"resent_timeout": 3, "aborted_resent": 3, "aborted_abandoned": 1,
                                "aborted_by_inference": 3}  # re-sends and the aborts that stop the originals
    failed = r.accounting(role_stats={}, steps=1, running_groups=1, failure="x" * 3000, rollout_restarts=0,
                          inference_restarts=0, transport={})
    assert not failed["finished"] and len(failed["failure"]) == 2000 and "lost_accepted_groups" not in failed


# -- ProgressWatch: no silent spinning ---------------------------------------------------------------------------


def open_watch(**kw) -> ProgressWatch:
    w = ProgressWatch(**kw)
    w.hold(False, 0.0)  # admission open
    return w


def test_watch_stops_when_nothing_is_accepted_while_groups_drop():
    w = open_watch(max_no_progress_s=100, warn_after_s=30)
    for t in range(1, 100):
        w.dropped("error:ValueError" if t % 3 else "timeout", float(t))
        verdict = w.check(float(t))
        assert verdict is None or verdict[0] == "warn"
    kind, text = w.check(100.0)
    assert kind == "stop" and "'error:ValueError'" in text and "max_no_progress_s=100" in text


def test_watch_warns_with_the_top_reason_then_again_later():
    w = open_watch(max_no_progress_s=1000, warn_after_s=30)
    w.dropped("env_error", 5.0, n=4)
    w.dropped("timeout", 6.0)
    assert w.check(29.0) is None
    kind, text = w.check(30.0)
    assert kind == "warn" and "no learner step for 30s" in text and "top reason 'env_error'" in text
    assert "env_error 4, timeout 1" in text
    assert w.check(45.0) is None and w.check(60.0)[0] == "warn"  # again every warn_after_s
    w.stepped(61.0)
    assert w.check(90.0) is None


def test_accepted_groups_and_steps_are_progress():
    w = open_watch(max_no_progress_s=100, max_consecutive_drops=5)
    for t in range(0, 1000, 10):
        w.dropped("uniform_groups", float(t))
        w.dropped("timeout", float(t) + 1)
        if t % 50 == 0:
            w.accepted(float(t) + 2)
        assert w.check(float(t) + 3) is None
    w.stepped(1000.0)  # a slow learner: no group accepted, but steps come
    assert w.check(1090.0) is None


def test_nothing_finishing_is_a_stall():
    """No drops and no accepts (leaked slots, a stuck learner, a lost push): a stall once the time is up, which the
    controller reports with what each role is doing."""
    w = open_watch(max_no_progress_s=100)
    assert w.check(99.0) is None
    kind, text = w.check(100.0)
    assert kind == "stall" and "no group dropped either" in text and "max_no_progress_s=100" in text
    w.stepped(101.0)  # a learner step is progress
    assert w.check(200.0) is None and w.check(201.0)[0] == "stall"


def test_held_time_does_not_count():
    w = ProgressWatch(max_no_progress_s=100)  # held until admission opens (warm-up, the first evaluation)
    w.dropped("timeout", 1.0)
    assert w.check(500.0) is None and w.since_progress == 0
    w.hold(False, 500.0)
    assert w.check(550.0) is None
    w.hold(True, 550.0)  # an evaluation
    assert w.check(900.0) is None and w.since_progress == 50
    w.hold(False, 900.0)
    assert w.check(949.0) is None and w.check(950.0)[0] == "stop"


def test_consecutive_drops_for_one_reason_stop_the_run():
    w = open_watch(max_consecutive_drops=5)
    for i in range(4):
        w.dropped("reward_error", float(i))
    w.dropped("timeout", 4.0)  # another reason starts a new streak
    for i in range(4):
        w.dropped("reward_error", 5.0 + i)
    assert w.check(9.0) is None
    w.dropped("reward_error", 10.0)
    kind, text = w.check(10.0)
    assert kind == "stop" and "last 5 prompt groups were all dropped for 'reward_error'" in text
    w.accepted(11.0)
    assert w.check(11.0) is None and w.streak == 0
    # the learner's drops are counted but make no streak: a peer flooding the learner with malformed groups (the
    # fuzz test) must not be able to stop the run; the no-progress timer still covers a run that only drops there
    w.dropped("learner_invalid", 12.0, n=500, streak=False)
    assert w.check(12.0) is None and w.streak == 0 and w.drops["learner_invalid"] == 500


def test_format_drops():
    assert format_drops({"a": 1, "b": 5, "c": 2, "d": 1, "accepted": 0}) == "b 5, c 2, a 1, +1 more"
    assert format_drops({}) == ""


def test_groups_filtered_as_uniform_make_no_streak_and_are_said_plainly():
    """Equal rewards in every group is the task's state at this setting, not a fault: no drop streak, a plain
    sentence in the warning and, once the time is up, in the stop (not a 'most for' failure report)."""
    w = open_watch(max_no_progress_s=100, max_consecutive_drops=5, warn_after_s=30)
    for t in range(0, 30):
        w.dropped("filtered" if t % 2 else "filtered:uniform_reward", float(t))
        assert w.check(float(t)) is None  # 30 in a row: no streak
    kind, text = w.check(30.0)
    assert kind == "warn" and text.endswith(UNIFORM_TEXT) and "top reason" not in text
    kind, text = w.check(100.0)
    assert kind == "stop" and UNIFORM_TEXT in text and "30 groups filtered as uniform" in text
    assert "see logs" not in text and "most for" not in text
    # one fault among them: reported as drops, with the top reason
    w.dropped("timeout", 101.0)
    assert "most for 'filtered" in w.check(101.0)[1]
    # uniform groups neither extend nor end a fault's streak
    w = open_watch(max_consecutive_drops=3)
    for t, reason in enumerate(["env_error", "filtered", "env_error", "filtered:uniform_reward", "env_error"]):
        w.dropped(reason, float(t))
    assert w.streak == 3 and w.check(5.0)[0] == "stop"


def test_a_stop_says_the_newest_error_of_its_reason():
    w = open_watch(max_consecutive_drops=3, max_no_progress_s=100)
    w.dropped("timeout", 1.0, error="the agent took longer than 5s")
    for t in (2.0, 3.0, 4.0):
        w.dropped("env_error:step:ValueError", t, error=f"Env.step raised ValueError: at {t:g}")
    kind, text = w.check(4.0)
    assert kind == "stop" and text.endswith("; its newest error:\nEnv.step raised ValueError: at 4")
    # by time: the error of the top reason; a reason without one: the newest of any reason
    w = open_watch(max_no_progress_s=100)
    w.dropped("error:KeyError", 1.0, n=3, error="KeyError: 'answer'")
    w.dropped("timeout", 2.0)
    text = w.check(100.0)[1]
    assert "most for 'error:KeyError' (3)" in text and text.endswith("; its newest error:\nKeyError: 'answer'")
    w = open_watch(max_no_progress_s=100)
    w.dropped("error:KeyError", 1.0, error="KeyError: 'answer'")
    w.dropped("timeout", 2.0, n=2)
    assert w.check(100.0)[1].endswith("; the newest error (for 'error:KeyError'):\nKeyError: 'answer'")
    # what it keeps is bounded: 32 reasons, 2000 characters each
    for i in range(100):
        w.dropped(f"error:E{i}", 3.0, error="x" * 10_000)
    assert len(w.errors) == 32 and "error:E99" in w.errors and max(map(len, w.errors.values())) == 2000


class _Gate:
    version, accepted, running = 3, 12, 4

    def capacity(self) -> int:
        return 0


def test_stall_report_says_what_each_role_is_doing():
    stats = {("rollout", 0): {"running": 0, "wanted": 2, "waiting_on": "nothing"},
             ("learner", 0): {"version": 3, "buffered_groups": 2, "buffered_trajectories": 8, "in_step_groups": 0,
                              "groups_received": 14, "trained_groups": 12,
                              "waiting_on": "waiting for a batch (2/4 groups buffered)"},
             ("inference", 0): {"version": 3}}
    text = stall_report(1000.0, gate=_Gate(), waiting=2, in_flight={0: 4},
                        processes={"rollout0": [("rollout", 0)], "rollout1": [("rollout", 1)],
                                   "learner": [("learner", 0)], "inference0": [("inference", 0), ("inference", 1)]},
                        role_stats=stats,
                        last_messages={"rollout0": {"heartbeat": 999.5, "group_done": 690.0},
                                       "learner": {"heartbeat": 999.0, "weights_published": 650.0}})
    lines = text.splitlines()
    assert lines[0] == "what each role is doing:"
    assert lines[1] == "  gate: version 3, 12 groups accepted, 4 in flight, room for 0 more, 2 asked for and waiting"
    assert lines[2] == ("  rollout0: 4 groups in flight (its own count: 0 running, 2 awaiting a grant), waiting on: "
                        "nothing; last messages: heartbeat 0.5s ago, group_done 310s ago")
    assert lines[3] == "  rollout1: 0 groups in flight (no heartbeat yet); last messages: none"
    assert lines[4].startswith("  learner: version 3, 2 groups buffered (8 trajectories), 0 in a step, 14 received, "
                               "12 trained, waiting on: waiting for a batch (2/4 groups buffered); last messages: ")
    assert lines[4].endswith("heartbeat 1.0s ago, weights_published 350s ago")
    assert lines[5] == "  inference0: server 0 at version 3; server 1 at version ?; last messages: none"


def test_a_lost_rollout_worker_the_learner_catching_up_and_the_summary():
    r = Reporter([], total_steps=2)
    r.rollout_lost([4, 2], 3, {"env": {"env_timeout": 1}})  # two groups the learner had, three lost
    assert r.accepted_groups == 2 and r.accepted_trajectories == 6 and r.lost_groups == 3
    assert r.group_reasons == {"accepted": 2, "lost_worker_died": 3} and r.env_of_restarted == {"env_timeout": 1}
    assert r.learner_caught_up({"groups_received": 2, "version": 1}, 1)
    assert not r.learner_caught_up({"groups_received": 1, "version": 1}, 1)
    assert not r.learner_caught_up({"groups_received": 2, "version": 1, "in_step_groups": 1}, 1)
    assert not r.learner_caught_up({}, 0)
    r.eval_done(2, {"n": 4, "first_acc": 0.5, "solved_acc": 0.75}, {})
    s = r.summary(run_dir="/r", steps=2, lost_inference={1})
    assert s["evals"] == {2: (0.5, 0.75)} and s["lost_inference"] == [1] and s["steps"] == 2
    assert s["groups"] == {"accepted": 2, "lost_worker_died": 3}


def test_memory_per_role_in_train_records_progress_and_summary():
    sink = ListSink()
    r = Reporter([sink], total_steps=8)
    for step, (roll, learn) in enumerate([(200.0, 900.0), (260.0, 905.0), (300.0, 910.0), (303.0, 908.0),
                                          (306.0, 920.0), (330.0, 915.0), (310.0, 912.0), (315.0, 911.0)], start=1):
        r.train(step, {}, {("rollout", 0): {"rss_mib": roll}, ("learner", 0): {"rss_mib": learn},
                           ("inference", 0): {"busy_s": 1.0}})  # a heartbeat without it: no entry
    train = sink.logged[0][0]
    assert train["rss_mib"]["rollout0"] == 200.0 and "inference0" not in train["rss_mib"]
    assert train["rss_mib"]["controller"] > 0  # the controller's own process
    assert r.memory.largest.startswith("learner0 ")
    mem = r.summary(run_dir="x", steps=8, lost_inference=[])["memory"]
    # a quarter of 8 steps: step 2 is the baseline the end is compared with (warm-up before it)
    assert mem["rollout0"] == {"first": 200.0, "first_step": 1, "quarter": 260.0, "quarter_step": 2, "end": 315.0,
                               "end_step": 8, "max": 330.0, "growth_pct": 21.2}
    assert mem["learner0"]["growth_pct"] == 0.7
    assert r.accounting(role_stats={}, steps=8, running_groups=0, failure=None, rollout_restarts=0,
                        inference_restarts=0, transport={})["memory"] == mem


def test_memory_track_stays_small_over_a_long_run():
    r = Reporter([], total_steps=100_000)
    for step in range(1, 5001):
        r.memory.note(step, {("rollout", 0): {"rss_mib": 250.0 + step % 7}})
    assert set(r.memory.roles) == {"controller", "rollout0"}
    row = r.memory.roles["rollout0"]  # a few numbers per role, no per-step list
    assert set(row) == {"first", "first_step", "max", "end", "end_step"} and row["end_step"] == 5000


def test_a_learner_rollback_takes_back_the_accepted_groups_its_checkpoint_does_not_hold():
    r = Reporter([], total_steps=4)
    for _ in range(5):
        r.group_done(True, "accepted", 4, None, None)
    assert r.learner_rollback(groups_settled=3, trajectories_settled=12) == 2
    assert r.accepted_groups == 3 and r.accepted_trajectories == 12
    assert r.group_reasons["lost_learner_restart"] == 2
    acct = r.accounting(role_stats={("learner", 0): {"groups_received": 3}}, steps=4, running_groups=0,
                        failure=None, rollout_restarts=0, inference_restarts=0, transport={}, learner_restarts=1)
    assert acct["learner_restarts"] == 1 and acct["lost_accepted_groups"] == 0


def test_endpoint_sessions_on_the_progress_line_and_a_worker_warning_said_once():
    sink = ListSink()
    r = Reporter([sink], total_steps=4)
    beat = {("rollout", 0): {"endpoint": {"sessions_running": 8, "sessions_waiting": 3}, "warning": "saturated"},
            ("rollout", 1): {"endpoint": {"sessions_running": 2, "sessions_waiting": 0}}}
    r.train(1, {}, beat)
    r.train(2, {}, beat)
    warnings = [rec for rec, _ in sink.logged if rec["type"] == "role_warning"]
    assert warnings == [{"type": "role_warning", "role": "rollout0", "text": "saturated",
                         "elapsed": warnings[0]["elapsed"]}]
    assert r._session_text == "10 running, 3 waiting"
