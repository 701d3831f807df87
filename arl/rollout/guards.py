"""Deadlines around untrusted code: every environment call an agent makes, and the agent itself.

`GuardedEnv` is the proxy the rollout worker hands to `collect_trajectory` instead of the user's environment:
`reset`/`step`/`close` each run under `timeout` seconds. A call that raises or overruns raises `EnvCallError`
into the agent *and* is remembered in `guard.failure`, so the group is dropped with that reason even if the agent
catches the exception and carries on (its trajectory would hold a made-up reward).

`call_with_deadline` runs a coroutine as its own task and, on expiry, cancels it and walks away: unlike
`asyncio.wait_for`, it never waits for a coroutine that swallows its cancellation, so a misbehaving agent or env
cannot hang the worker. (A coroutine that blocks the event loop itself cannot be interrupted from inside the
process; the controller's heartbeat timeout catches that case.)
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
from typing import Any, Awaitable, Optional

from arl.api.agent import EnvironmentService
from arl.api.types import check_reward
from arl.utils.errors import describe_error

logger = logging.getLogger("arl.rollout")

__all__ = ["EnvCallError", "GuardedEnv", "DeadlineExceeded", "call_with_deadline"]


class DeadlineExceeded(TimeoutError):
    """`call_with_deadline` gave up on a coroutine (it was cancelled and abandoned)."""


class EnvCallError(RuntimeError):
    """An environment call failed or overran its deadline. `reason` is the drop reason counted in metrics:
    ``env_timeout:<method>`` or ``env_error:<method>:<ExceptionType>``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _consume(task: asyncio.Task) -> None:
    """Done-callback of an abandoned task: fetch its outcome so asyncio does not log 'never retrieved'."""
    if not task.cancelled():
        task.exception()


async def call_with_deadline(aw: Awaitable[Any], timeout: Optional[float]) -> Any:
    """Await `aw` for at most `timeout` seconds (None: no limit). On expiry the task is cancelled and abandoned
    and `DeadlineExceeded` is raised at once; if the caller is cancelled, so is the task."""
    if timeout is None:
        return await aw
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(_consume)
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_consume)
        raise DeadlineExceeded(f"no result within {timeout:g}s")
    return task.result()


class GuardedEnv(EnvironmentService):
    """Proxy of `env` whose calls each have a deadline; other attributes pass through to the wrapped env.

    `stats` (optional, shared by the worker's guards) counts ``env_calls``, ``env_timeout``, ``env_error``,
    ``env_calls_in_flight`` and, from `info["error"]` of steps that returned normally, ``reward_timeout`` /
    ``env_info_error`` (the math env reports a timed-out reward function there and gives reward 0).
    """

    def __init__(self, env: EnvironmentService, timeout: float, stats: Optional[collections.Counter] = None,
                 close_timeout: float = 5.0) -> None:
        if not (timeout > 0):
            raise ValueError(f"env timeout must be > 0 seconds, got {timeout!r}")
        self.wrapped = env
        self._timeout = float(timeout)
        self._close_timeout = min(float(close_timeout), self._timeout)
        self.stats = stats if stats is not None else collections.Counter()
        self.failure: Optional[str] = None  # reason of the first failed call
        self.failure_detail: Optional[str] = None  # its message and where it was raised (bounded)

    def __getattr__(self, name: str) -> Any:  # only called for attributes the proxy itself lacks
        if name.startswith("__") or name == "wrapped":
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    async def _call(self, method: str, timeout: float, *args: Any, **kwargs: Any) -> Any:
        self.stats["env_calls"] += 1
        result = getattr(self.wrapped, method)(*args, **kwargs)
        if not inspect.isawaitable(result):  # a synchronous method already ran to completion
            return result
        self.stats["env_calls_in_flight"] += 1
        try:
            return await call_with_deadline(result, timeout)
        except DeadlineExceeded:
            self.stats["env_timeout"] += 1
            raise self._fail(f"env_timeout:{method}",
                             f"{type(self.wrapped).__name__}.{method} took longer than {timeout:g}s") from None
        except Exception as e:  # noqa: BLE001 - any env bug becomes a counted drop reason
            self.stats["env_error"] += 1
            raise self._fail(f"env_error:{method}:{type(e).__name__}",
                             f"{type(self.wrapped).__name__}.{method} raised {type(e).__name__}: {e}", e) from e
        finally:
            self.stats["env_calls_in_flight"] -= 1

    def _fail(self, reason: str, message: str, cause: Optional[BaseException] = None) -> EnvCallError:
        if self.failure is None:
            self.failure, self.failure_detail = reason, describe_error(message, cause)
        return EnvCallError(reason, message)

    async def reset(self, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None) -> tuple[Any, dict]:
        return await self._call("reset", self._timeout, seed=seed, options=options)

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        out = await self._call("step", self._timeout, action)
        if not isinstance(out, (tuple, list)) or len(out) != 5:
            raise self._fail("env_error:step:BadResult",
                             f"{type(self.wrapped).__name__}.step must return (obs, reward, terminated, truncated, "
                             f"info), got {type(out).__name__}")
        try:
            check_reward(out[1])  # a finite number, or one finite number per answer (AReaL's stateless envs)
        except ValueError as e:
            raise self._fail("env_error:step:BadReward",
                             f"{type(self.wrapped).__name__}.step returned a non-finite or non-numeric reward "
                             f"{out[1]!r:.60} ({e})") from None
        info = out[4]
        if isinstance(info, dict) and info.get("error"):
            err = str(info["error"])
            self.stats["reward_timeout" if "timed out" in err else "env_info_error"] += 1
        return out  # type: ignore[return-value]

    async def close(self) -> None:
        failure, detail = self.failure, self.failure_detail
        try:
            await self._call("close", self._close_timeout)
        except EnvCallError as e:  # closing is best effort; the group's fate is already decided
            self.failure, self.failure_detail = failure, detail
            logger.warning("%s", e)
