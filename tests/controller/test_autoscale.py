"""The autoscale rule: grow while the learner waits for data, shrink while rollout workers wait on the gate, within
bounds, nothing during a cooldown or while a server joins."""

from __future__ import annotations

import pytest

from arl.controller.autoscale import Autoscaler, AutoscalePolicy


def window(a: Autoscaler, t: float, blocked: float, idle: float, train: float, serving: int, joining: int = 0):
    for k in range(10):
        a.sample(k < blocked * 10)
    return a.decide(t, learner_idle_s=idle, learner_train_s=train, serving=serving, joining=joining)


def test_grows_when_the_learner_waits_and_shrinks_when_generation_waits():
    a = Autoscaler(AutoscalePolicy(min_servers=1, max_servers=3, interval_s=10, cooldown_s=15, memory_s=35))
    assert window(a, 0, 0, 0, 0, serving=1) is None  # the first call starts the window
    d = window(a, 10, blocked=0.0, idle=8, train=2, serving=1)  # learner idle 80%
    assert d.change == +1 and d.learner_idle == pytest.approx(0.8) and "learner waited" in d.reason
    assert window(a, 20, blocked=0.0, idle=16, train=4, serving=2) is None  # cooldown (15 s from t=10)
    assert window(a, 30, blocked=0.0, idle=24, train=6, serving=2, joining=1) is None  # still joining
    assert window(a, 40, blocked=0.0, idle=32, train=8, serving=2).change == +1
    assert window(a, 60, blocked=0.0, idle=40, train=10, serving=3) is None  # at max_servers
    d = window(a, 80, blocked=0.8, idle=40, train=20, serving=3)  # the learner never waits, the gate holds
    assert d.change == -1 and d.gate_blocked == pytest.approx(0.8) and d.learner_idle == 0
    assert window(a, 100, blocked=0.9, idle=40, train=30, serving=1) is None  # at min_servers
    # the gate holding groups while the learner waits is no reason to shrink (more groups asked than eta admits)
    assert window(a, 120, blocked=0.9, idle=48, train=32, serving=2).change == +1
    assert window(a, 140, blocked=0.9, idle=49, train=40, serving=2) is None  # learner idle 10%: neither
    # at 3 the learner is the bottleneck, but it starved at 2 a moment ago (t=120): no swing back ...
    assert window(a, 150, blocked=0.9, idle=49, train=50, serving=3) is None
    # ... until that is memory_s (35 s) old
    assert window(a, 160, blocked=0.9, idle=49, train=60, serving=3).change == -1


def test_no_step_in_the_window_is_no_signal():
    a = Autoscaler(AutoscalePolicy(interval_s=5, cooldown_s=0))
    window(a, 0, 0, 0, 0, serving=1)
    assert window(a, 5, blocked=0.0, idle=0, train=0, serving=1) is None


def test_policy_bounds_are_checked():
    with pytest.raises(ValueError):
        AutoscalePolicy(min_servers=3, max_servers=2)
