import math

import pytest

from arl.utils.histogram import LogHistogram


def test_quantiles_within_one_bucket_and_window_difference():
    h = LogHistogram(lo=1e-4, hi=10.0, per_octave=8)
    assert math.isnan(h.quantile(0.5))
    for i in range(1, 101):
        h.add(i * 1e-3)  # 1 ms .. 100 ms
    width = 2 ** (1 / 8)
    assert 0.050 <= h.quantile(0.5) <= 0.050 * width * 1.001
    assert 0.099 <= h.quantile(0.99) <= 0.099 * width * 1.001
    before = h.to_list()
    h.add(5.0, count=10)
    window = h.minus(before)
    assert window.total == 10 and 5.0 <= window.quantile(0.5) <= 5.0 * width
    h.add(1e-9)
    h.add(1e9)
    assert h.counts[0] == 1 and h.counts[-1] == 1
    assert LogHistogram(lo=1e-4, hi=10.0, per_octave=8, counts=h.to_list()).total == h.total


def test_bad_arguments():
    with pytest.raises(ValueError):
        LogHistogram(lo=1.0, hi=0.5)
    with pytest.raises(ValueError):
        LogHistogram(counts=[1, 2])
