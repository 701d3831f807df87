"""Train/test rows for an experiment: the built-in a+b task, jsonl files, HuggingFace datasets files on disk, or
the built-in arithmetic word problems (tool agents)."""

from __future__ import annotations

from typing import Any

from arl.data.arith import make_arith_splits
from arl.data.jsonl import load_jsonl


DATASETS = ("arith", "jsonl", "hf", "word-arith")


def load_splits(*, name: str, train_path: str = "", test_path: str = "", max_operand: int = 49,
                test_size: int = 200, seed: int = 0, prompt_field: str = "",
                answer_field: str = "") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if name == "arith":
        return make_arith_splits(max_operand=max_operand, test_size=test_size, seed=seed)
    if name == "jsonl":
        if not train_path:
            raise ValueError("dataset.name=jsonl needs dataset.train_path")
        return load_jsonl(train_path), (load_jsonl(test_path) if test_path else [])
    if name == "hf":
        from arl.data.hf import load_hf

        if not train_path:
            raise ValueError("dataset.name=hf needs dataset.train_path (a save_to_disk folder or a parquet file)")
        kw = {"prompt_field": prompt_field, "answer_field": answer_field}
        return load_hf(train_path, split="train", **kw), (load_hf(test_path, split="test", **kw) if test_path else [])
    if name == "word-arith":
        from arl.data.word_problems import make_word_problem_splits

        return make_word_problem_splits(test_size=test_size, seed=seed)
    raise ValueError(f"unknown dataset {name!r}; known: {list(DATASETS)}")
