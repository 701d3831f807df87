"""Any gymnasium env as an `EnvironmentService` (registered as "gymnasium"; needs `pip install 'arl[envs]'`).

    env.name=gymnasium env.args={id: FrozenLake-v1, make_args: {is_slippery: false}}

Observations become text: a string as it is; a `Discrete` state as `obs_template` ("state {obs}"); a `Box` as its
numbers rounded to `decimals`, space-separated; with `render: true` (and `make_args.render_mode: ansi`) the env's
text rendering. Actions come from the model's text (see `arl.envs.text_env`): for a `Discrete` action space the
first integer in it (or, with `action_names`, the first of those words it contains: its index), for a `Box` the
first `shape` numbers, for a `Text` space the text. gymnasium calls are synchronous: they run in worker threads,
off the event loop, under `timeout`. An unknown env id is refused when the run starts (`check`), with the id.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import numpy as np


from arl.envs.text_env import SyncTextEnv
from arl.utils.optional import import_optional

_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?\d+(?:\.\d+)?(?:[eE]-?\d+)?")


def _gymnasium() -> Any:
    return import_optional("gymnasium", "env.name=gymnasium needs gymnasium: pip install 'arl[envs]'")


class GymnasiumEnv(SyncTextEnv):
    def __init__(self, id: str, make_args: Optional[dict[str, Any]] = None, obs_template: str = "state {obs}",
                 decimals: int = 2, render: bool = False, action_names: Sequence[str] = (),
                 action_regex: str = "", timeout: float = 30.0, max_obs_chars: int = 0,
                 invalid_action_reward: float = 0.0, end_on_invalid: bool = False) -> None:
        super().__init__(timeout=timeout, action_regex=action_regex, max_obs_chars=max_obs_chars,
                         invalid_action_reward=invalid_action_reward, end_on_invalid=end_on_invalid)
        self.check(id=id, make_args=make_args)
        self.id = id
        self.make_args = dict(make_args or {})
        self.obs_template = obs_template
        self.decimals = int(decimals)
        self.render = bool(render)
        self.action_names = [str(a).lower() for a in action_names]

    @staticmethod
    def check(id: str = "", make_args: Optional[dict[str, Any]] = None, **_: Any) -> None:
        """Refuse an id gymnasium does not know (before any process starts), naming it."""
        gym = _gymnasium()
        if not isinstance(id, str) or not id:
            raise ValueError("env.args.id: the gymnasium env id is missing (e.g. FrozenLake-v1)")
        if id not in gym.registry:
            close = sorted(k for k in gym.registry if k.lower().split("-")[0] == id.lower().split("-")[0])
            raise ValueError(f"gymnasium env id {id!r} is not registered" +
                             (f"; did you mean {close}?" if close else f" ({len(gym.registry)} ids are)"))
        if make_args is not None and not isinstance(make_args, dict):
            raise ValueError(f"env.args.make_args must be a map of gymnasium.make arguments, got {make_args!r}")

    def _make(self) -> Any:
        return _gymnasium().make(self.id, **self.make_args)

    def _format_obs(self, obs: Any) -> str:
        if self.render:
            out = self._env.render()
            return out if isinstance(out, str) else str(out)
        if isinstance(obs, str):
            return obs
        if isinstance(obs, (int, np.integer)):
            return self.obs_template.replace("{obs}", str(int(obs)))
        arr = np.asarray(obs)
        if arr.dtype.kind in "fc":
            return " ".join(f"{x:.{self.decimals}f}" for x in arr.reshape(-1))
        return " ".join(str(x) for x in arr.reshape(-1).tolist())

    def _to_action(self, text: str) -> Any:
        spaces = _gymnasium().spaces
        space = self._env.action_space
        if isinstance(space, spaces.Discrete):
            low, n = int(space.start), int(space.n)
            if self.action_names:
                lower = text.lower()
                found = [(lower.find(w), i) for i, w in enumerate(self.action_names) if w in lower]
                if not found:
                    raise ValueError(f"none of {self.action_names} in {text[:40]!r}")
                return low + min(found)[1]
            m = _INT.search(text)
            if m is None or not low <= int(m.group(0)) < low + n:
                raise ValueError(f"expected an integer in [{low}, {low + n - 1}], got {text[:40]!r}")
            return int(m.group(0))
        if isinstance(space, spaces.Box):
            nums = [float(x) for x in _FLOAT.findall(text)]
            size = int(np.prod(space.shape))
            if len(nums) < size:
                raise ValueError(f"expected {size} numbers, got {len(nums)} in {text[:40]!r}")
            return np.clip(np.asarray(nums[:size], dtype=space.dtype).reshape(space.shape), space.low, space.high)
        if isinstance(space, spaces.Text):
            return text
        raise ValueError(f"gymnasium action space {space} is not supported (Discrete, Box, Text)")
