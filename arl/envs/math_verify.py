"""Math answer checking with HuggingFace `math-verify` (LaTeX, \\boxed{}, fractions, GSM8K "#### 72"), run in a
small process pool with a timeout, as a reward function for `MathEnv`:

    env.name=math env.args.reward_fn=arl.envs.math_verify:math_verify_reward env.args.timeout=60

Why a process pool: parsing and comparing go through sympy (slow on some inputs, can hang, holds the GIL, and
math-verify's own timeouts use signals, which only work in a main thread). A check that overruns
`task_timeout` gets its worker processes killed and the pool replaced; the reward is then 0 with an error.
The first check starts the pool (imports sympy: a few seconds), so give `MathEnv` a generous timeout.

`extract_answer(text)` is a light, dependency-free extraction of the final answer (last \\boxed{...}, GSM8K
"#### x", "the answer is x", else the last number), for logging and for data preparation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import multiprocessing
import os
import re
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Optional

logger = logging.getLogger(__name__)

__all__ = ["extract_answer", "extract_boxed", "gold_answer", "verify_answer", "MathVerifier",
           "math_verify_reward", "default_verifier"]

_NUM = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?"


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        m = re.findall(r"\\boxed\s+([^\s$]+)", text)  # "\boxed 5"
        return m[-1] if m else None
    i = starts[-1]
    depth, j = 1, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
        j += 1
    return None  # unbalanced


def extract_answer(text: str) -> Optional[str]:
    """The final answer stated in `text` (a model completion or a reference solution), as a string."""
    if not isinstance(text, str) or not text.strip():
        return None
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    m = re.findall(r"####\s*(.+)", text)
    if m:
        return m[-1].strip().replace(",", "").rstrip(".")
    m = re.findall(r"answer is[:\s]*\$?([^\n$]+?)\$?\s*(?:\.\s|\.$|$|\n)", text, re.I)
    if m:
        return m[-1].strip()
    nums = re.findall(_NUM, text)
    return nums[-1].replace(",", "") if nums else None


def gold_answer(answer: str) -> str:
    """A reference answer as math-verify should read it: GSM8K solutions keep only what follows "####"."""
    answer = str(answer).strip()
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip()
    return answer


# ------------------------------------------------------------------------------------- inside the pool


def _parse_gold(gold: str) -> Any:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    if "$" not in gold and "\\boxed" not in gold:
        parsed = parse(f"${gold}$", extraction_config=[LatexExtractionConfig()])
        if parsed:
            return parsed
    return parse(gold, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])


def verify_answer(completion: str, answer: str, float_rounding: int = 6) -> float:
    """1.0 if `completion` states an answer math-verify finds equal to `answer`, else 0.0. Call it in the pool
    (or any main thread): math-verify's timeouts use signals."""
    from math_verify import parse, verify

    gold = _parse_gold(gold_answer(answer))
    if not gold:
        raise ValueError(f"could not parse the reference answer {answer!r}")
    pred = parse(completion)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, float_rounding=float_rounding) else 0.0


def _warm() -> None:
    import math_verify  # noqa: F401 - pay the sympy import once per pool process

    verify_answer("1", "1")


# --------------------------------------------------------------------------------------------- the pool


class MathVerifier:
    """A process pool that checks answers with `verify_answer`. `task_timeout` bounds one check once it runs
    (waiting for a free process does not count; a new pool gets `startup_timeout` more for its first check);
    a check past it gets the pool's processes killed and the pool replaced."""

    def __init__(self, max_workers: int = 2, task_timeout: float = 10.0, float_rounding: int = 6,
                 startup_timeout: float = 60.0, fn: Any = None) -> None:
        self.fn = fn or verify_answer  # a module-level function (it is pickled by name into the pool)
        self.max_workers = max(1, int(max_workers))
        self.task_timeout = float(task_timeout)
        self.startup_timeout = float(startup_timeout)
        self._warm_pools: set[int] = set()
        self.float_rounding = float_rounding
        self._pool: Optional[concurrent.futures.ProcessPoolExecutor] = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.max_workers)
        self.stats = {"checks": 0, "timeouts": 0, "errors": 0, "restarts": 0}

    def _get_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads/asyncio/zmq
                self._pool = concurrent.futures.ProcessPoolExecutor(self.max_workers, mp_context=ctx,
                                                                    initializer=_warm)
            return self._pool

    def _restart(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is not pool:
                return
            self._pool = None
            self._warm_pools.discard(id(pool))
            self.stats["restarts"] += 1
        for p in list(getattr(pool, "_processes", {}).values()):
            with contextlib.suppress(Exception):
                p.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def check(self, completion: str, answer: str) -> float:
        """Blocking check (call it from a thread, e.g. MathEnv's reward pool). Raises TimeoutError on a hung
        check; other failures propagate as exceptions (MathEnv turns both into reward 0 + error)."""
        self.stats["checks"] += 1
        with self._slots:
            for attempt in range(2):
                pool = self._get_pool()
                fut = pool.submit(self.fn, completion, answer, self.float_rounding)
                warm = id(pool) in self._warm_pools  # a new pool first starts processes and imports sympy
                try:
                    result = float(fut.result(timeout=self.task_timeout + (0.0 if warm else self.startup_timeout)))
                    self._warm_pools.add(id(pool))
                    return result
                except concurrent.futures.TimeoutError:
                    self.stats["timeouts"] += 1
                    self._restart(pool)
                    raise TimeoutError(f"math-verify took longer than {self.task_timeout:g}s") from None
                except BrokenProcessPool:
                    self._restart(pool)
                    if attempt == 1:
                        self.stats["errors"] += 1
                        raise RuntimeError("math-verify worker process died") from None
        raise RuntimeError("unreachable")

    async def acheck(self, completion: str, answer: str) -> float:
        return await asyncio.get_running_loop().run_in_executor(None, self.check, completion, answer)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


@functools.cache
def default_verifier() -> MathVerifier:
    """The process-wide verifier (ARL_MATH_VERIFY_WORKERS processes, default 2)."""
    return MathVerifier(max_workers=int(os.environ.get("ARL_MATH_VERIFY_WORKERS", "2")))


async def math_verify_reward(completion: str, answer: str) -> float:
    """Async reward fn for MathEnv: the check runs in the process pool; the event loop never blocks."""
    return await default_verifier().acheck(completion, answer)
