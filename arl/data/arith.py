"""The built-in arithmetic task: all sums a+b with a, b in 0..max_operand, split into train and held-out test."""

from __future__ import annotations

import random


def make_arith_splits(max_operand: int = 49, test_size: int = 200, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Return `(train, test)`: rows `{"id": "a+b", "prompt": "a+b=", "answer": "c"}`, disjoint by id.

    The (max_operand+1)^2 pairs are shuffled with `seed`; the first `test_size` form the test split.
    """
    if not isinstance(max_operand, int) or max_operand < 0:
        raise ValueError(f"max_operand must be an int >= 0, got {max_operand!r}")
    n = (max_operand + 1) ** 2
    if not isinstance(test_size, int) or not 0 <= test_size < n:
        raise ValueError(f"test_size must be an int in [0, {n}) for max_operand={max_operand}, got {test_size!r}")
    rows = [
        {"id": f"{a}+{b}", "prompt": f"{a}+{b}=", "answer": str(a + b)}
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]
    random.Random(seed).shuffle(rows)
    return rows[test_size:], rows[:test_size]
