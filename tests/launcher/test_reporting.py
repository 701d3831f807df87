"""Reporter: records to every sink, trajectory means, idle fraction, accounting."""

from __future__ import annotations

import json

from arl.launcher.reporting import JsonlSink, ProgressWatch, Reporter, format_drops


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
    r.eval_requested(2)
    assert r.evals == {2: {}}
    line = r.eval_done(2, {"version": 2, "n": 4, "first_acc": 0.5, "solved_acc": 0.75}, {("rollout", 0): {"x": 1}})
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


def test_nothing_finishing_is_not_spinning():
    """No drops and no accepts (say, long generations): the trajectory timeout and the heartbeats guard that."""
    w = open_watch(max_no_progress_s=100)
    assert w.check(500.0) is None


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
