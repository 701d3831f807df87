"""A fixed-bucket log histogram for latencies: cheap to update, small to ship in a heartbeat, and two snapshots
subtract, so a benchmark can take percentiles over its own measurement window."""

from __future__ import annotations

import bisect
import math
from typing import Optional, Sequence


class LogHistogram:
    """Counts of values in log-spaced buckets from `lo` to `hi` (`per_octave` buckets per doubling).

    Bucket 0 holds values below `lo`, the last bucket values at or above `hi`. Quantiles are read at a bucket's
    upper edge, so they over-state by at most one bucket width (2**(1/per_octave) - 1, 9% with the default).
    """

    def __init__(self, lo: float = 1e-5, hi: float = 1e3, per_octave: int = 8,
                 counts: Optional[Sequence[int]] = None) -> None:
        if not 0 < lo < hi or per_octave < 1:
            raise ValueError("need 0 < lo < hi and per_octave >= 1")
        self.lo, self.hi, self.per_octave = lo, hi, per_octave
        n = int(math.ceil(math.log2(hi / lo) * per_octave))
        self.edges = [lo * 2 ** (i / per_octave) for i in range(n + 1)]
        self.counts = list(counts) if counts is not None else [0] * (n + 2)
        if len(self.counts) != n + 2:
            raise ValueError(f"counts must have {n + 2} entries, got {len(self.counts)}")

    def add(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_right(self.edges, value)] += count

    @property
    def total(self) -> int:
        return sum(self.counts)

    def quantile(self, q: float) -> float:
        """Upper edge of the bucket holding the q-quantile (nan when empty)."""
        total = self.total
        if total == 0:
            return math.nan
        rank = q * total
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return self.edges[min(i, len(self.edges) - 1)]
        return self.edges[-1]

    def minus(self, earlier: "LogHistogram | Sequence[int]") -> "LogHistogram":
        """This histogram less an earlier snapshot of it (the counts of a time window)."""
        base = earlier.counts if isinstance(earlier, LogHistogram) else list(earlier)
        return LogHistogram(self.lo, self.hi, self.per_octave, [a - b for a, b in zip(self.counts, base)])

    def to_list(self) -> list[int]:
        return list(self.counts)
