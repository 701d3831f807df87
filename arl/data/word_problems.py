"""Arithmetic word problems for tool-calling agents (the "tool-calc" experiment).

    {"id": "wp-17", "prompt": "Tom has 23 pens and gets 17 more. How many pens?", "answer": "40",
     "expression": "23+17", "op": "+"}

Two-digit operands make the sums and products hard to do "in the head" for the tiny model, and easy with the
calculator: the point is learning when and how to call it. Only characters of the tiny tokenizer are used.
The wording is templated (one per operation) so the tiny model can learn the call format on CPU in minutes.
"""

from __future__ import annotations

import random

NAMES = ["Tom"]
ITEMS = ["pens"]
# One fixed wording per operation: a 0.5M-parameter char model learns to copy numbers from fixed offsets within
# a few hundred warm-up steps; varied names and items (add them here) make that much slower.
TEMPLATES = {"+": "{n} has {a} {i} and gets {b} more. How many {i}?",
             "-": "{n} has {a} {i} and gives away {b}. How many {i} are left?",
             "*": "{n} buys {a} bags with {b} {i} each. How many {i}?"}


def make_problem(rng: random.Random, lo: int = 10, hi: int = 99, ops: str = "+-*") -> dict:
    op = rng.choice(ops)
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    if op == "-" and b > a:
        a, b = b, a
    if op == "*":
        b = rng.randint(2, 9)  # keep products to three digits
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    n, i = rng.choice(NAMES), rng.choice(ITEMS)
    return {"prompt": TEMPLATES[op].format(n=n, a=a, b=b, i=i), "answer": str(value), "expression": f"{a}{op}{b}",
            "op": op}


def make_word_problem_splits(n_train: int = 4000, test_size: int = 200, seed: int = 0, lo: int = 10,
                             hi: int = 99, ops: str = "+-*") -> tuple[list[dict], list[dict]]:
    """(train, test) rows, disjoint by prompt text."""
    if test_size < 0 or n_train < 1:
        raise ValueError(f"need n_train >= 1 and test_size >= 0, got {n_train}, {test_size}")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    tries = 0
    while len(rows) < n_train + test_size:
        tries += 1
        if tries > 50 * (n_train + test_size):
            raise ValueError("not enough distinct problems for the requested sizes")
        p = make_problem(rng, lo, hi, ops)
        if p["prompt"] in seen:
            continue
        seen.add(p["prompt"])
        p["id"] = f"wp-{len(rows)}"
        rows.append(p)
    return rows[test_size:], rows[:test_size]
