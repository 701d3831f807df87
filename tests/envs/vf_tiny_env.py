"""A tiny verifiers environment for the adapter's tests: a+b questions the tiny model knows, an exact-match
rubric."""

from __future__ import annotations

import random
from typing import Any


def load_environment(size: int = 64, seed: int = 0) -> Any:
    import datasets
    import verifiers.legacy as vf

    rng = random.Random(seed)
    pairs = [(rng.randint(0, 49), rng.randint(0, 49)) for _ in range(size)]
    ds = datasets.Dataset.from_list([{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs])

    def exact(completion: Any, answer: str, **_: Any) -> float:
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        return 1.0 if (text or "").strip() == answer else 0.0

    return vf.SingleTurnEnv(dataset=ds, rubric=vf.Rubric(funcs=[exact]))
