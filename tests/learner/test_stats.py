"""The named statistics tracker: each reduction by hand, over one process and over simulated ranks."""

import math

import pytest

from arl.learner.stats import StatsTracker


def test_each_reduction_in_one_process():
    s = StatsTracker()
    for v, w in ((3.0, 4.0), (1.0, 4.0)):
        s.add("clip", v, "mean", weight=w)  # 4 of 8 tokens clipped
        s.add("n", w)
        s.add("hi", v, "max")
        s.add("lo", v, "min")
    s.add("empty", 0.0, "mean", weight=0.0, default=1.0)
    assert s.reduce() == {"clip": 0.5, "n": 8.0, "hi": 3.0, "lo": 1.0, "empty": 1.0}
    assert "clip" in s and "other" not in s


def test_a_name_keeps_its_reduction():
    s = StatsTracker()
    s.add("x", 1.0)
    with pytest.raises(ValueError, match="sum"):
        s.add("x", 1.0, "max")
    with pytest.raises(ValueError):
        StatsTracker().add("y", 1.0, "median")  # type: ignore[arg-type]


def test_reduce_over_ranks_packs_names_in_sorted_order():
    """Two ranks that added the same names in different orders: one sum vector and one max vector each."""
    ranks = [StatsTracker(), StatsTracker()]
    ranks[0].add("b_tokens", 2.0)
    ranks[0].add("a_frac", 1.0, "mean", weight=2.0)
    ranks[0].add("v_min", 5.0, "min")
    ranks[0].add("v_max", 5.0, "max")
    ranks[1].add("a_frac", 3.0, "mean", weight=6.0)
    ranks[1].add("v_max", 9.0, "max")
    ranks[1].add("v_min", math.inf, "min")  # a rank with nothing to report adds the identity
    ranks[1].add("b_tokens", 6.0)
    sent: dict[str, list[list[float]]] = {"sum": [], "max": []}

    def record(values: list[float], op: str) -> list[float]:  # what each rank puts into the collective
        sent[op].append(list(values))
        return values

    for r in ranks:
        r.reduce(record)
    assert sent["sum"] == [[1.0, 2.0, 2.0], [3.0, 6.0, 6.0]]  # a_frac (total, weight), b_tokens: sorted names
    assert sent["max"] == [[5.0, -5.0], [9.0, -math.inf]]  # v_max, -v_min

    def all_reduce(values: list[float], op: str) -> list[float]:  # the collective's answer on every rank
        a, b = sent[op]
        return [x + y if op == "sum" else max(x, y) for x, y in zip(a, b)]

    for r in ranks:
        assert r.reduce(all_reduce) == {"a_frac": 0.5, "b_tokens": 8.0, "v_max": 9.0, "v_min": 5.0}
