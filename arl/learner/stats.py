"""A small named statistics tracker: values are added by name with how they combine, then reduced over ranks in
at most two collectives.

Why: a learner step gathers a dozen statistics from every micro-batch on every rank; naming each with its
reduction replaces a positional tuple that had to be packed and unpacked in the same order.

Reductions: ``sum``; ``mean`` (sum of the values over sum of the weights: a value is a total over ``weight``
units, e.g. clipped tokens over loss tokens; ``default`` when no weight arrived); ``max``; ``min``. Every rank must
add the same names (add zeros rather than skipping), because names are packed in sorted order into one vector.
"""

from __future__ import annotations

import math
from typing import Callable, Literal, Optional

__all__ = ["StatsTracker", "AllReduce"]

Reduce = Literal["sum", "mean", "max", "min"]
AllReduce = Callable[[list[float], str], list[float]]  # (values, "sum" | "max") -> values reduced over ranks


class StatsTracker:
    def __init__(self) -> None:
        self._kind: dict[str, Reduce] = {}
        self._acc: dict[str, list[float]] = {}  # sum: [total]; mean: [total, weight]; max/min: [extreme]
        self._default: dict[str, float] = {}

    def add(self, name: str, value: float, reduce: Reduce = "sum", weight: float = 1.0,
            default: float = 0.0) -> None:
        if reduce not in ("sum", "mean", "max", "min"):
            raise ValueError(f"unknown reduction {reduce!r}")
        kind = self._kind.setdefault(name, reduce)
        if kind != reduce:
            raise ValueError(f"stat {name!r} is reduced by {kind}, not {reduce}")
        if name not in self._acc:
            self._acc[name] = {"sum": [0.0], "mean": [0.0, 0.0], "max": [-math.inf], "min": [math.inf]}[reduce]
            self._default[name] = default
        acc, value = self._acc[name], float(value)
        if reduce in ("sum", "mean"):
            acc[0] += value
            if reduce == "mean":
                acc[1] += float(weight)
        else:
            acc[0] = max(acc[0], value) if reduce == "max" else min(acc[0], value)

    def __contains__(self, name: str) -> bool:
        return name in self._acc

    def reduce(self, all_reduce: Optional[AllReduce] = None) -> dict[str, float]:
        """The statistics over every add on every rank (``all_reduce=None``: this process only). Collective when
        ``all_reduce`` is given: every rank calls it with the same names."""
        names = sorted(self._acc)
        sums = [x for n in names if self._kind[n] in ("sum", "mean") for x in self._acc[n]]
        maxes = [(self._acc[n][0] if self._kind[n] == "max" else -self._acc[n][0])
                 for n in names if self._kind[n] in ("max", "min")]
        if all_reduce is not None:
            sums = all_reduce(sums, "sum") if sums else sums
            maxes = all_reduce(maxes, "max") if maxes else maxes
        out: dict[str, float] = {}
        s, m = iter(sums), iter(maxes)
        for n in names:
            kind = self._kind[n]
            if kind == "sum":
                out[n] = next(s)
            elif kind == "mean":
                total, weight = next(s), next(s)
                out[n] = total / weight if weight > 0 else self._default[n]
            else:
                out[n] = next(m) if kind == "max" else -next(m)
        return out
