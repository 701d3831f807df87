"""reasoning-gym's procedural tasks, both as a data set and as the reward (needs `pip install 'arl[envs]'`).

    dataset.name=reasoning-gym dataset.tasks=[basic_arithmetic,chain_sum] env.name=reasoning-gym

The data set (`reasoning_gym_splits`): for each task `reasoning_gym.create_dataset(task, size=train_size,
seed=seed)` gives the training rows and one with another seed and `test_size` entries the held-out rows; each
row has the entry's question as `prompt`, its `answer`, and where it came from (`rg_task`, `rg_size`, `rg_seed`,
`rg_index`). The env (`ReasoningGymEnv`) is reset with such a row and rewards an answer with the task's own
`score_answer(answer, entry)` (the same data set, rebuilt once per process from those four values), run off the
event loop under `timeout`; one step ends the episode. `correct` is reward >= `correct_threshold`. An unknown task name is refused when the
run starts, with the name.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional, Sequence

from arl.api import EnvironmentService
from arl.envs.text_env import SPECIAL_TOKENS, env_thread_pool
from arl.utils.optional import import_optional


def _rg() -> Any:
    return import_optional("reasoning_gym", "reasoning-gym tasks need reasoning-gym: pip install 'arl[envs]'")


def check_tasks(tasks: Sequence[str]) -> None:
    """ValueError naming every task reasoning-gym does not have (and listing some it has)."""
    from reasoning_gym.factory import DATASETS

    _rg()
    if not tasks:
        raise ValueError("reasoning-gym: no task names given (dataset.tasks=[basic_arithmetic, ...])")
    unknown = [t for t in tasks if t not in DATASETS]
    if unknown:
        raise ValueError(f"reasoning-gym tasks {unknown} are unknown; it has {len(DATASETS)}, e.g. "
                         f"{sorted(DATASETS)[:12]}")


@functools.lru_cache(maxsize=64)
def task_dataset(task: str, size: int, seed: int) -> Any:
    """One task's data set (deterministic for its name, size and seed), made once per process."""
    return _rg().create_dataset(task, size=size, seed=seed)


def _rows(task: str, size: int, seed: int) -> list[dict[str, Any]]:
    ds = task_dataset(task, size, seed)
    return [{"id": f"{task}-{seed}-{i}", "prompt": str(e["question"]), "answer": str(e["answer"]), "rg_task": task,
             "rg_size": size, "rg_seed": seed, "rg_index": i} for i, e in enumerate(ds)]


def reasoning_gym_splits(tasks: Sequence[str], train_size: int = 1000, test_size: int = 200,
                         seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, test rows) over `tasks`; the test rows come from a second seed (the task's generator decides
    whether two seeds can draw the same question)."""
    check_tasks(tasks)
    if train_size < 1 or test_size < 0:
        raise ValueError(f"reasoning-gym: train_size must be >= 1 and test_size >= 0, got {train_size}, {test_size}")
    train = [r for t in tasks for r in _rows(t, train_size, seed)]
    test = [r for t in tasks for r in _rows(t, test_size, seed + 1_000_003)] if test_size else []
    return train, test


class ReasoningGymEnv(EnvironmentService):
    """One question's reward: reset with a row of `reasoning_gym_splits`, step with the model's text."""

    def __init__(self, timeout: float = 10.0, correct_threshold: float = 1.0, answer_regex: str = "") -> None:
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.correct_threshold = float(correct_threshold)
        self.answer_regex = re.compile(answer_regex, re.S) if answer_regex else None
        self.row: Optional[dict[str, Any]] = None

    @staticmethod
    def check(**_: Any) -> None:
        _rg()

    async def reset(self, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None) -> tuple[Any, dict]:
        opts = options or {}
        if all(k in opts for k in ("rg_task", "rg_size", "rg_seed", "rg_index")):
            self.row = {k: opts[k] for k in ("rg_task", "rg_size", "rg_seed", "rg_index")}
            return opts.get("prompt"), {}
        if options is not None:  # a reset without a reasoning-gym row: nothing to score against
            self.row = None
        return None, {}

    def _score(self, row: dict[str, Any], answer: str) -> float:
        ds = task_dataset(str(row["rg_task"]), int(row["rg_size"]), int(row["rg_seed"]))
        return float(ds.score_answer(answer, ds[int(row["rg_index"])]))

    def extract(self, text: str) -> str:
        text = SPECIAL_TOKENS.sub("", text).strip()
        if self.answer_regex is not None:
            m = self.answer_regex.search(text)
            text = "" if m is None else (m.group(1) if self.answer_regex.groups else m.group(0)).strip()
        return text

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        if self.row is None:
            return None, 0.0, True, False, {"correct": False, "error": "no reasoning-gym row: reset with one first"}
        if not isinstance(action, str):
            return None, 0.0, True, False, {"correct": False,
                                            "error": f"action must be the answer text, got {type(action).__name__}"}
        try:
            reward = await env_thread_pool().run(self._score, self.row, self.extract(action), timeout=self.timeout)
        except TimeoutError:
            return None, 0.0, True, False, {"correct": False, "error": f"score_answer timed out ({self.timeout:g}s)"}
        except Exception as e:  # noqa: BLE001 - a task's scorer that raises gives 0, with why
            return None, 0.0, True, False, {"correct": False, "error": f"score_answer: {type(e).__name__}: {e}"}
        correct = reward >= self.correct_threshold
        return None, reward, True, False, {"correct": correct, "error": None, "task": self.row["rg_task"]}
