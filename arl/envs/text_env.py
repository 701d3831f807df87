"""The common part of the adapters for synchronous environment libraries (gymnasium, GEM): their calls run off the
event loop under a timeout, their observations become text an agent can show the model, and the model's text
becomes an action.

    obs text  = format_obs(obs) with its tail kept (`max_obs_chars`)
    action    = parse(text): the first match of `action_regex` (group 1 if it has one, else the whole match),
                put through `action_template` ("\\boxed{{{action}}}" makes "7" the GEM answer "\\boxed{7}")

A text the parser finds no action in is not sent to the env: the step gives `invalid_action_reward`, keeps the
episode going (unless `end_on_invalid`) and says why in `info["error"]`. `step` and `reset` raise only for a
broken env (the rollout worker's guard drops that group with a counted reason) or a timeout.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import re
from typing import Any, Optional

import numpy as np

from arl.api import EnvironmentService
from arl.envs.math import SPECIAL_TOKENS, _DaemonThreadPool


@functools.cache
def env_thread_pool() -> _DaemonThreadPool:
    """The process-wide threads the synchronous envs' calls run in (a hung call's thread is written off)."""
    return _DaemonThreadPool(max_workers=32, hard_cap=256, name="arl-env")


def plain_info(value: Any, depth: int = 0) -> Any:
    """`value` as msgpack carries it: numpy scalars and arrays as numbers and lists, tuples as lists, dict keys as
    strings; anything else as its repr (an info dict must never fail a step, nor the wire)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist() if value.size <= 4096 else repr(value)[:200]
    if depth > 8:
        return repr(value)[:200]
    if isinstance(value, dict):
        return {str(k): plain_info(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_info(v, depth + 1) for v in value]
    return repr(value)[:200]


class TextActionParser:
    """Model text -> an action string (None: no action in it). See the module docstring."""

    def __init__(self, action_regex: str = "", action_template: str = "{action}") -> None:
        try:
            self.regex = re.compile(action_regex, re.S) if action_regex else None
        except re.error as e:
            raise ValueError(f"action_regex {action_regex!r} is not a regular expression: {e}") from None
        if "{action}" not in action_template:
            raise ValueError(f"action_template must contain '{{action}}', got {action_template!r}")
        self.template = action_template

    def __call__(self, text: str) -> Optional[str]:
        text = SPECIAL_TOKENS.sub("", text).strip()
        if self.regex is not None:
            m = self.regex.search(text)
            if m is None:
                return None
            text = (m.group(1) if self.regex.groups else m.group(0)).strip()
        if not text:
            return None
        return self.template.replace("{action}", text)


class SyncTextEnv(EnvironmentService, abc.ABC):
    """An EnvironmentService over one synchronous env made by `_make()` (subclasses: the adapters). Each instance
    holds one env; its calls run one at a time in `env_thread_pool()` under `timeout` seconds."""

    def __init__(self, *, timeout: float = 30.0, action_regex: str = "", action_template: str = "{action}",
                 max_obs_chars: int = 0, invalid_action_reward: float = 0.0, end_on_invalid: bool = False) -> None:
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if not isinstance(max_obs_chars, int) or max_obs_chars < 0:
            raise ValueError(f"max_obs_chars must be an int >= 0 (0: whole observations), got {max_obs_chars!r}")
        self.timeout = float(timeout)
        self.parse_action = TextActionParser(action_regex, action_template)
        self.max_obs_chars = max_obs_chars
        self.invalid_action_reward = float(invalid_action_reward)
        self.end_on_invalid = bool(end_on_invalid)
        self._env: Any = None
        self._obs = ""
        self._lock = asyncio.Lock()

    @abc.abstractmethod
    def _make(self) -> Any:
        """The synchronous env (called in a worker thread)."""

    @abc.abstractmethod
    def _to_action(self, text: str) -> Any:
        """The env's action for the parsed action text; ValueError when it is not one."""

    def _format_obs(self, obs: Any) -> str:
        return obs if isinstance(obs, str) else str(plain_info(obs))

    def _text(self, obs: Any) -> str:
        text = self._format_obs(obs)
        return text[-self.max_obs_chars:] if self.max_obs_chars and len(text) > self.max_obs_chars else text

    async def _run(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return await env_thread_pool().run(fn, *args, timeout=self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{type(self).__name__}.{what} took longer than {self.timeout:g}s") from None

    def _reset_sync(self, seed: Optional[int]) -> tuple[Any, dict]:
        if self._env is None:
            self._env = self._make()
        return self._env.reset(seed=seed)

    async def reset(self, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None) -> tuple[Any, dict]:
        """A new episode. A row's `seed` (the `env-seeds` data set's rows carry one) wins over `seed`, so every
        member of a group and every evaluation of a row starts alike."""
        if options and options.get("seed") is not None:
            seed = int(options["seed"])
        async with self._lock:
            obs, info = await self._run("reset", self._reset_sync, None if seed is None else int(seed))
        self._obs = self._text(obs)
        return self._obs, plain_info(info or {})

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        if self._env is None:
            raise RuntimeError(f"{type(self).__name__}.step before reset")
        if not isinstance(action, str):
            return self._invalid(f"the action must be the model's text (str), got {type(action).__name__}")
        parsed = self.parse_action(action)
        if parsed is None:
            return self._invalid(f"no action found in {action[:80]!r}")
        try:
            env_action = self._to_action(parsed)
        except ValueError as e:
            return self._invalid(f"not an action: {e}")
        async with self._lock:
            obs, reward, terminated, truncated, info = await self._run("step", self._env.step, env_action)
        self._obs = self._text(obs)
        info = plain_info(info or {})
        info = info if isinstance(info, dict) else {"info": info}
        info.setdefault("error", None)
        return self._obs, float(reward), bool(terminated), bool(truncated), info

    def _invalid(self, why: str) -> tuple[Any, float, bool, bool, dict]:
        return self._obs, self.invalid_action_reward, self.end_on_invalid, False, {"error": why, "invalid_action": True}

    async def close(self) -> None:
        env, self._env = self._env, None
        if env is not None and hasattr(env, "close"):
            try:
                await self._run("close", env.close)
            except Exception:  # noqa: BLE001 - a failing close loses nothing
                pass
