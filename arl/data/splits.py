"""Train/test rows for an experiment: the built-in a+b task, jsonl files, HuggingFace datasets files on disk, the
built-in arithmetic word problems (tool agents), reasoning-gym's tasks, a verifiers environment's data set, or bare seeds (envs that make their own
task on reset: gymnasium, GEM)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from arl.data.arith import make_arith_splits
from arl.config import DATASETS
from arl.data.jsonl import load_jsonl

TEST_SEED_OFFSET = 1_000_000  # env-seeds: the held-out seeds start here (never a training seed)


def seed_rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    """Rows that carry only a seed: the env's reset makes the task from it (`arl.envs.text_env`)."""
    return [{"id": f"seed-{s}", "seed": s} for s in range(start, start + n)]


def load_splits(*, name: str, train_path: str = "", test_path: str = "", max_operand: int = 49,
                test_size: int = 200, seed: int = 0, prompt_field: str = "", answer_field: str = "",
                tasks: Sequence[str] = (), train_size: int = 1000, verifiers_env: str = "",
                verifiers_args: Optional[dict[str, Any]] = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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
    if name == "reasoning-gym":
        from arl.envs.reasoning_gym_env import reasoning_gym_splits

        return reasoning_gym_splits(list(tasks), train_size=train_size, test_size=test_size, seed=seed)
    if name == "verifiers":
        from arl.envs.verifiers_env import verifiers_splits

        return verifiers_splits(verifiers_env, verifiers_args, train_size=train_size, test_size=test_size)
    if name == "env-seeds":
        return seed_rows(train_size), seed_rows(test_size, TEST_SEED_OFFSET)
    raise ValueError(f"unknown dataset {name!r}; known: {list(DATASETS)}")
