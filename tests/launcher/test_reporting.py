"""Reporter: records to every sink, trajectory means, idle fraction, accounting."""

from __future__ import annotations

import json

from arl.launcher.reporting import JsonlSink, Reporter


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
                  ("rollout", 0): {"env": {"env_timeout": 2}}}
    acct = r.accounting(role_stats=role_stats, steps=2, running_groups=0, failure=None, rollout_restarts=1,
                        inference_restarts=0, transport={"controller": {}})
    assert acct["finished"] and acct["accepted_groups"] == 1 and acct["lost_in_flight_groups"] == 2
    assert acct["groups"] == {"accepted": 1, "lost_worker_died": 2} and acct["env"] == {"env_timeout": 3}
    assert acct["lost_accepted_groups"] == 0 and acct["learner_balance"] == 0
    assert acct["transport"] == {"controller": {}, "learner0": {"sent": 5}}
    failed = r.accounting(role_stats={}, steps=1, running_groups=1, failure="x" * 3000, rollout_restarts=0,
                          inference_restarts=0, transport={})
    assert not failed["finished"] and len(failed["failure"]) == 2000 and "lost_accepted_groups" not in failed
