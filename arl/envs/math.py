"""The math environment: a stateless wrapper around a pluggable reward function.

    env = MathEnv()                               # reward_fn="arl.envs.math:exact_number_match", timeout=5.0
    await env.reset(options={"answer": "19"})
    _, reward, terminated, truncated, info = await env.step("19")   # 1.0, True, False, {"correct": True, ...}

The reward function runs off the event loop, in a shared pool of daemon threads, under `asyncio.wait_for`;
a timeout or an exception gives reward 0.0 and the error in `info["error"]`; `step` never raises. A function
marked with `@inline_reward` (a pure check that takes microseconds on any input, such as the built-in
`exact_number_match`) is called on the event loop instead: the hop to a pool thread and back costs ~50x the check
itself, and the default run makes hundreds of checks a training step.
One env instance holds one reference answer: use one instance per prompt (`make_env("math")` is cheap).

A hung reward function cannot be killed (it is a thread); its worker is written off and a replacement is
allowed, up to a hard cap, after which checks queue and time out. Code execution and other risky checks belong
in a subprocess inside the reward function.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import pkgutil
import queue
import re
import sys
import threading
import time
import traceback
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Optional, Union

from arl.api import EnvironmentService, register_env

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], Any]

SPECIAL_TOKENS = re.compile(r"<\|[^|<>]*\|>|<eos>|<pad>|<unk>|<s>|</s>")  # chat/special tokens in decoded text
_NUMBER_RE = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _to_number(s: str) -> Optional[Decimal]:
    s = s.strip().replace(",", "")
    try:
        d = Decimal(s)
    except (InvalidOperation, ValueError):
        return None
    return d if d.is_finite() else None


def inline_reward(fn: RewardFn) -> RewardFn:
    """Mark `fn` as safe to call on the event loop: pure, and bounded to microseconds for any completion (linear
    work on the text, no I/O, no model, no parser that can blow up). Anything else stays unmarked: it runs in the
    pool, under the env's timeout."""
    fn.__arl_inline__ = True  # type: ignore[attr-defined]
    return fn


def is_inline_reward(fn: Any) -> bool:
    return getattr(fn, "__arl_inline__", False) is True


@inline_reward
def exact_number_match(completion: str, answer: str) -> float:
    """1.0 if the first number stated in `completion` (special tokens and whitespace stripped) equals `answer`
    numerically, else 0.0. `answer` may be an int or decimal string ("19", "19.0")."""
    ref = _to_number(str(answer))
    if ref is None:
        return 0.0
    text = SPECIAL_TOKENS.sub(" ", completion).strip()
    m = _NUMBER_RE.search(text)
    if m is None:
        return 0.0
    return 1.0 if _to_number(m.group(0)) == ref else 0.0


def resolve_reward_fn(reward_fn: Union[str, RewardFn]) -> RewardFn:
    """Accept a callable or a "package.module:function" string."""
    if callable(reward_fn):
        return reward_fn
    if not isinstance(reward_fn, str) or ":" not in reward_fn:
        raise ValueError(f"reward_fn must be a callable or a 'module:function' string, got {reward_fn!r}")
    try:
        obj = pkgutil.resolve_name(reward_fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward_fn {reward_fn!r}: cannot import it ({e})") from e
    if not callable(obj):
        raise ValueError(f"reward_fn {reward_fn!r} is not callable")
    return obj


class _DaemonThreadPool(concurrent.futures.Executor):
    """A small thread pool whose workers are daemon threads (a hung reward call never blocks interpreter exit,
    unlike ThreadPoolExecutor) and whose hung workers can be written off and replaced up to `hard_cap`."""

    def __init__(self, max_workers: int = 4, hard_cap: int = 64, name: str = "arl-reward") -> None:
        self.max_workers = max_workers
        self.hard_cap = hard_cap
        self.name = name
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._written_off = 0
        self._abandoned: set[concurrent.futures.Future] = set()
        self._threads_of: dict[concurrent.futures.Future, int] = {}  # running future -> thread ident

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fut, fn, args, kwargs))
        with self._lock:
            live = self._threads - self._written_off
            if self._idle == 0 and live < self.max_workers and self._threads < self.hard_cap:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True).start()
        return fut

    def abandon(self, fut: concurrent.futures.Future) -> None:
        """The caller gave up on `fut`: cancel it if still queued, else write its worker off (until it returns)."""
        if fut.cancel():
            return
        with self._lock:
            if fut.running() and fut not in self._abandoned:
                self._abandoned.add(fut)
                self._written_off += 1
                if self._threads >= self.hard_cap:
                    logger.warning("%s: %d reward calls are hung; new checks will queue", self.name, self._written_off)

    async def run(self, fn: Callable, *args: Any, timeout: float,
                  on_timeout: Optional[Callable[[str], None]] = None) -> Any:
        """Await `fn(*args)` in the pool under `timeout`. A caller that times out or is cancelled abandons the call
        (`abandon`); `on_timeout` first gets the stack the call hangs in."""
        cfut = self.submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(cfut), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if on_timeout is not None and isinstance(e, asyncio.TimeoutError):
                on_timeout(self.stack_of(cfut))
            self.abandon(cfut)
            raise

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            item = self._q.get()
            with self._lock:
                self._idle -= 1
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            self._threads_of[fut] = threading.get_ident()
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            else:
                fut.set_result(result)
            finally:
                self._threads_of.pop(fut, None)
            with self._lock:
                if fut in self._abandoned:
                    self._abandoned.discard(fut)
                    self._written_off -= 1

    def stack_of(self, fut: concurrent.futures.Future) -> str:
        """The Python stack of the thread running `fut` right now ("" if it is not running)."""
        tid = self._threads_of.get(fut)
        frame = sys._current_frames().get(tid) if tid is not None else None
        return "".join(traceback.format_stack(frame)) if frame is not None else ""


REWARD_TIMEOUTS: "dict[str, int]" = {}  # reward function name -> timeouts in this process
_last_timeout_log: dict[str, float] = {}


def _fn_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _log_reward_timeout(fn: Any, timeout: float, stack: str) -> None:
    """Name a hung reward function in the log, with where it hangs (first time, then at most every 10 s)."""
    name = _fn_name(fn)
    n = REWARD_TIMEOUTS[name] = REWARD_TIMEOUTS.get(name, 0) + 1
    now = time.monotonic()
    if now - _last_timeout_log.get(name, -1e9) < 10.0:
        return
    _last_timeout_log[name] = now
    where = f"; it is stuck in:\n{stack}" if stack else ""
    logger.warning("reward function %s timed out after %gs (%d timeouts so far; reward 0 given)%s", name, timeout,
                   n, where)


@functools.cache
def reward_pool() -> _DaemonThreadPool:
    """The process-wide pool reward functions run in (made on first use, from the event loop's thread)."""
    return _DaemonThreadPool()


class MathEnv(EnvironmentService):
    """Stateless reward wrapper. `reset(options={"answer": ...})` stores the reference answer;
    `step(completion_text)` returns `(None, reward, correct, False, {"correct": bool, "error": str | None})`."""

    def __init__(self, reward_fn: Union[str, RewardFn] = "arl.envs.math:exact_number_match", timeout: float = 5.0,
                 correct_threshold: float = 1.0) -> None:
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"MathEnv timeout must be > 0 seconds, got {timeout!r}")
        self.reward_fn = resolve_reward_fn(reward_fn)
        self._inline = is_inline_reward(self.reward_fn)
        self.timeout = float(timeout)
        self.correct_threshold = float(correct_threshold)
        self.answer: Optional[str] = None

    async def reset(self, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None) -> tuple[Any, dict]:
        answer = (options or {}).get("answer")
        self.answer = None if answer is None else str(answer)
        return None, {}

    async def _call(self, completion: str, answer: str) -> Any:
        if self._inline:
            return self.reward_fn(completion, answer)
        if inspect.iscoroutinefunction(self.reward_fn):
            try:
                return await asyncio.wait_for(self.reward_fn(completion, answer), self.timeout)
            except asyncio.TimeoutError:
                _log_reward_timeout(self.reward_fn, self.timeout, "")
                raise
        return await reward_pool().run(self.reward_fn, completion, answer, timeout=self.timeout,
                                       on_timeout=lambda stack: _log_reward_timeout(self.reward_fn, self.timeout,
                                                                                    stack))

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        if self.answer is None:
            return _no_reward("no reference answer: call reset(options={'answer': ...}) first")
        if not isinstance(action, str):
            return _no_reward(f"action must be the completion text (str), got {type(action).__name__}")
        try:
            raw = await self._call(action, self.answer)
            reward = float(raw)
            if reward != reward:  # NaN
                raise ValueError("reward function returned NaN")
        except asyncio.TimeoutError:
            return _no_reward(f"reward timed out after {self.timeout:g}s ({_fn_name(self.reward_fn)})")
        except Exception as e:  # noqa: BLE001 - a bad reward function must not kill the worker
            return _no_reward(f"reward error: {type(e).__name__}: {e}")
        correct = reward >= self.correct_threshold
        return None, reward, correct, False, {"correct": correct, "error": None}


def _no_reward(error: str) -> tuple[Any, float, bool, bool, dict]:
    """A step that gives reward 0 and says why (`step` never raises)."""
    return None, 0.0, False, False, {"correct": False, "error": error}


register_env("math", MathEnv)
