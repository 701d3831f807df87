"""`max_head_offpolicyness=auto`: the staleness steering's rule, the gate admitting at the steered eta, and the
controller shell turning a learner step's signals into a `staleness_change` record and new grants."""

from __future__ import annotations

import dataclasses
import json

import pytest

from arl.api.staleness import StalenessPolicy
from arl.config import ExperimentConfig, StalenessAutoConfig, eta_bound, parse_overrides, staleness_policy
from arl.controller import steering as steering_module
from arl.rollout.staleness import StalenessGate
from arl.utils.errors import ConfigError

from .test_controller_faults import make_controller


def StalenessSteering(**kw) -> steering_module.StalenessSteering:
    """The steering with `staleness_auto`'s defaults, `kw` replacing some."""
    return steering_module.StalenessSteering(**{**dataclasses.asdict(StalenessAutoConfig()), **kw})


HEALTHY = {"mismatch_kl": 1e-6, "clip_frac": 0.01, "capped_frac": 0.0, "grad_norm": 1.0}


def run(s: StalenessSteering, steps: list[dict], start: int = 1) -> list[tuple[int, int, int, str]]:
    out = []
    for i, m in enumerate(steps, start):
        c = s.observe(i, m)
        if c is not None:
            out.append((c.step, c.old, c.new, c.signal))
    return out


def test_healthy_steps_raise_eta_by_one_up_to_the_bound():
    s = StalenessSteering(eta_min=1, eta_max=4, eta_start=2, raise_after=3)
    assert run(s, [HEALTHY] * 12) == [(3, 2, 3, "healthy"), (6, 3, 4, "healthy")]
    assert s.eta == 4  # and no further


def test_a_signal_past_its_threshold_halves_eta_and_names_it():
    bad = {**HEALTHY, "clip_frac": 0.2, "capped_frac": 0.05}
    lone = StalenessSteering(eta_min=1, eta_max=8, eta_start=8, raise_after=50)
    assert run(lone, [HEALTHY] * 9 + [bad] + [HEALTHY] * 5) == []  # one noisy step: the 5-step mean stays below
    s = StalenessSteering(eta_min=1, eta_max=8, eta_start=8, raise_after=50)
    changes = run(s, [HEALTHY] * 9 + [bad] * 2)
    # 5-step means at step 11: clip (3 x 0.01 + 2 x 0.2) / 5 = 0.086 (1.7x its limit), capped 0.02 (at it): clip
    assert changes == [(11, 8, 4, "clip_frac")]
    assert s.changes[0].value == pytest.approx(0.086) and s.changes[0].threshold == 0.05
    assert "clip_frac 0.086 > 0.05" in s.changes[0].line()


def test_no_second_cut_until_the_data_admitted_under_the_first_is_trained():
    s = StalenessSteering(eta_min=1, eta_max=8, eta_start=8, raise_after=50)
    bad = {**HEALTHY, "mismatch_kl": 0.5}
    s._since_change = 100  # long past the start
    changes = run(s, [bad] * 16)
    # judged from step 5 (5 steps in); 8 -> 4 at once; then 4 steps of batches admitted at eta 8 pass before
    # 4 -> 2; then 2 more before 2 -> 1
    assert changes == [(5, 8, 4, "mismatch_kl"), (10, 4, 2, "mismatch_kl"), (13, 2, 1, "mismatch_kl")]
    assert run(s, [bad] * 5, start=17) == []  # eta_min holds


def test_a_grad_norm_spike_is_judged_against_the_recent_median():
    s = StalenessSteering(eta_start=4, eta_max=8, raise_after=100, grad_norm_spike=5.0, window=10)
    s._since_change = 100
    assert run(s, [{**HEALTHY, "grad_norm": 1.0 + 0.01 * i} for i in range(10)]) == []
    (change,) = run(s, [{**HEALTHY, "grad_norm": 20.0}], start=11)
    assert change[1:] == (4, 2, "grad_norm")


def test_missing_signals_are_not_judged():
    s = StalenessSteering(eta_start=2, raise_after=2)
    assert run(s, [{}, {}]) == [(2, 2, 3, "healthy")]  # a learner that reports nothing (simulated) is healthy


def test_the_gate_admits_at_the_steered_eta_never_above_the_bound():
    gate = StalenessGate(batch_size=4, policy=StalenessPolicy(8), max_concurrent=1000)
    assert gate.capacity() == 9 * 4
    gate.admitted_eta = 1
    assert gate.capacity() == 2 * 4
    gate.admitted_eta = 20  # above the bound: the bound
    assert gate.capacity() == 9 * 4


def test_auto_in_the_config_bounds_the_learner_at_eta_max():
    cfg = parse_overrides(ExperimentConfig, ["max_head_offpolicyness=auto", "staleness_auto.eta_max=6"])
    assert eta_bound(cfg) == 6 and staleness_policy(cfg).eta == 6
    assert eta_bound(parse_overrides(ExperimentConfig, ["max_head_offpolicyness=3"])) == 3
    with pytest.raises(ConfigError, match="'auto'"):
        parse_overrides(ExperimentConfig, ["max_head_offpolicyness=sometimes"])
    with pytest.raises(ConfigError, match="eta_min <= eta_start <= eta_max"):
        parse_overrides(ExperimentConfig, ["max_head_offpolicyness=auto", "staleness_auto.eta_start=9"])


@pytest.mark.asyncio
async def test_the_controller_moves_the_gate_and_writes_the_change(tmp_path):
    steering = StalenessSteering(eta_min=1, eta_max=4, eta_start=4, raise_after=50, smooth=1)
    steering._since_change = 100
    ctl = make_controller(tmp_path, num_rollout=1, batch_size=1, staleness=StalenessPolicy(4), steering=steering,
                          total_train_steps=100)
    await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0})
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl.grant(ctl.admission.open())
    assert ctl.gate.admitted_eta == 4
    await ctl._dispatch(b"r0", "gate_acquire", {"want": 10, "incarnation": "aa"})
    assert ctl.gate.running == 5  # (0 + 4 + 1) * 1
    await ctl._dispatch(b"L", "weights_published", {"version": 1, "path": "/w/1",
                                                    "metrics": {**HEALTHY, "capped_frac": 0.5}})
    assert ctl.gate.admitted_eta == 2
    ctl.reporter.close()
    recs = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    (change,) = [r for r in recs if r["type"] == "staleness_change"]
    assert (change["from"], change["to"], change["signal"], change["step"]) == (4, 2, "capped_frac", 1)
    (train,) = [r for r in recs if r["type"] == "train"]
    assert train["admitted_eta"] == 4  # the eta its batch was admitted at; the next record carries 2
