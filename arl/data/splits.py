"""Train/test rows for an experiment, from the built-in arithmetic task or jsonl files."""

from __future__ import annotations

from typing import Any

from arl.data.arith import make_arith_splits
from arl.data.jsonl import load_jsonl


def load_splits(*, name: str, train_path: str = "", test_path: str = "", max_operand: int = 49,
                test_size: int = 200, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if name == "arith":
        return make_arith_splits(max_operand=max_operand, test_size=test_size, seed=seed)
    if name == "jsonl":
        if not train_path:
            raise ValueError("dataset.name=jsonl needs dataset.train_path")
        train = load_jsonl(train_path)
        test = load_jsonl(test_path) if test_path else []
        return train, test
    raise ValueError(f"unknown dataset {name!r}; known: ['arith', 'jsonl']")
