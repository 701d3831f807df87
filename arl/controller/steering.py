"""A staleness budget that steers itself (`max_head_offpolicyness=auto`): pure logic, no I/O.

The controller admits prompt groups at an eta between `eta_min` and `eta_max` (the learner's hard bound). After
each learner step it shows `StalenessSteering` the step's health signals; the steering lowers eta when one crosses
its threshold and raises it again while they stay healthy, to keep the inference fleet busy:

- **down, by half** (``eta // 2``, not below `eta_min`) when a signal is past its threshold: the mean of the last
  `smooth` steps' `mismatch_kl`, `clip_frac` or `capped_frac` above its maximum (one noisy step is not a trend: in
  the default run at eta 2 a single step's clip_frac passes 0.05 about once in a hundred; judged once `smooth`
  steps are in, so the first steps' transient, clip_frac ~0.08 at any eta, does not count), or the step's
  `grad_norm` above `grad_norm_spike` times the median of the last `window` steps. Not again until more than eta steps passed since the last change: the
  batches trained before then were admitted under the previous eta, and lowering it again would punish the
  same data twice;
- **up, by one** (not above `eta_max`) after `raise_after` healthy steps in a row since the last change.

Additive increase, multiplicative decrease: it backs off fast when training gets into trouble and probes
upwards slowly. Each change is a `StalenessChange` (the record ``staleness_change`` and a console line).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Optional


@dataclasses.dataclass(frozen=True)
class StalenessChange:
    step: int
    old: int
    new: int
    signal: str  # what moved it: a signal's name, or 'healthy' for a raise
    value: float
    threshold: float

    def record(self) -> dict:
        return {"step": self.step, "from": self.old, "to": self.new, "signal": self.signal, "value": self.value,
                "threshold": self.threshold}

    def line(self) -> str:
        if self.signal == "healthy":
            why = f"{int(self.value)} healthy steps"
        else:
            why = f"{self.signal} {self.value:.4g} > {self.threshold:.4g}"
        return f"staleness: eta {self.old} -> {self.new} at step {self.step} ({why})"


class StalenessSteering:
    """Steers the admitted eta from the learner's step metrics (see the module docstring)."""

    def __init__(self, *, eta_min: int, eta_max: int, eta_start: int, raise_after: int, mismatch_kl_max: float,
                 clip_frac_max: float, capped_frac_max: float, grad_norm_spike: float, window: int,
                 smooth: int) -> None:
        """The settings of `staleness_auto.*` (`arl.config.StalenessAutoConfig`, where their defaults live)."""
        if not 1 <= eta_min <= eta_start <= eta_max:
            raise ValueError(f"need 1 <= eta_min <= eta_start <= eta_max, got {eta_min} / {eta_start} / {eta_max}")
        self.eta_min, self.eta_max, self.eta = int(eta_min), int(eta_max), int(eta_start)
        self.raise_after = int(raise_after)
        self.limits = {"mismatch_kl": float(mismatch_kl_max), "clip_frac": float(clip_frac_max),
                       "capped_frac": float(capped_frac_max)}
        self.grad_norm_spike = float(grad_norm_spike)
        self._grad: collections.deque[float] = collections.deque(maxlen=max(1, int(window)))
        self._recent = {k: collections.deque(maxlen=max(1, int(smooth))) for k in self.limits}
        self._healthy = 0  # healthy steps in a row
        self._since_change = 0
        self.changes: list[StalenessChange] = []

    def signal(self, metrics: dict) -> Optional[tuple[str, float, float]]:
        """The signal furthest past its threshold (name, value, threshold) given a new step's metrics, or None:
        healthy. A signal the learner did not report is not judged."""
        worst: Optional[tuple[str, float, float]] = None
        checks: list[tuple[str, object, float]] = []
        for k, limit in self.limits.items():
            v = metrics.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:
                self._recent[k].append(float(v))
                if len(self._recent[k]) == self._recent[k].maxlen:  # the first steps' transient is not judged
                    checks.append((k, statistics.fmean(self._recent[k]), limit))
        g = metrics.get("grad_norm")
        if self.grad_norm_spike > 0 and len(self._grad) >= min(5, self._grad.maxlen or 5):
            checks.append(("grad_norm", g, self.grad_norm_spike * statistics.median(self._grad)))
        for name, value, limit in checks:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or limit <= 0 or value <= limit:
                continue
            if worst is None or value / limit > worst[1] / worst[2]:
                worst = (name, float(value), float(limit))
        return worst

    def observe(self, step: int, metrics: dict) -> Optional[StalenessChange]:
        """One learner step's metrics; the change it makes to eta, if any."""
        bad = self.signal(metrics)
        g = metrics.get("grad_norm")
        if isinstance(g, (int, float)) and not isinstance(g, bool) and g == g:
            self._grad.append(float(g))
        self._since_change += 1
        change: Optional[StalenessChange] = None
        if bad is not None:
            self._healthy = 0
            if self.eta > self.eta_min and self._since_change > self.eta:
                change = StalenessChange(step, self.eta, max(self.eta_min, self.eta // 2), *bad)
        else:
            self._healthy += 1
            if self.eta < self.eta_max and self._healthy >= self.raise_after and self._since_change >= self.raise_after:
                change = StalenessChange(step, self.eta, self.eta + 1, "healthy", float(self._healthy), 0.0)
        if change is not None:
            self.eta, self._since_change, self._healthy = change.new, 0, 0
            self.changes.append(change)
        return change
