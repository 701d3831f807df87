"""A GEM env (`gem.make(id)`: text observations and text actions) as an `EnvironmentService` (registered as
"gem"; needs `pip install 'arl[envs]'`).

    env.name=gem env.args={id: 'game:GuessTheNumber-v0-easy', action_template: '\\boxed{{action}}'}

`make_args` go to `gem.make`; `wrappers` names GEM's own wrappers (`gem.wrappers.wrapper_factory`, applied in the
order given, e.g. `[python_tool, concat]`). GEM envs are synchronous: calls run in worker threads, off the event
loop, under `timeout`. The text an agent generates is the action (through `action_regex` / `action_template`,
`arl.envs.text_env`). An unknown id or wrapper is refused when the run starts (`check`), with its name.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


from arl.envs.text_env import SyncTextEnv
from arl.utils.optional import import_optional


def _gem() -> Any:
    return import_optional("gem", "env.name=gem needs gem-llm: pip install 'arl[envs]'")


class GemEnv(SyncTextEnv):
    def __init__(self, id: str, make_args: Optional[dict[str, Any]] = None, wrappers: Sequence[str] = (),
                 action_regex: str = "", action_template: str = "{action}", timeout: float = 30.0,
                 max_obs_chars: int = 0, invalid_action_reward: float = 0.0, end_on_invalid: bool = False) -> None:
        super().__init__(timeout=timeout, action_regex=action_regex, action_template=action_template,
                         max_obs_chars=max_obs_chars, invalid_action_reward=invalid_action_reward,
                         end_on_invalid=end_on_invalid)
        self.check(id=id, make_args=make_args, wrappers=wrappers)
        self.id = id
        self.make_args = dict(make_args or {})
        self.wrappers = list(wrappers)

    @staticmethod
    def check(id: str = "", make_args: Optional[dict[str, Any]] = None, wrappers: Sequence[str] = (),
              **_: Any) -> None:
        """Refuse an id or wrapper GEM does not know (before any process starts), naming it."""
        _gem()
        from gem.envs.registration import ENV_REGISTRY
        from gem.wrappers.wrapper_factory import WRAPPER_FACTORY

        if not isinstance(id, str) or id not in ENV_REGISTRY:
            prefix = str(id).split("-")[0]
            close = sorted(k for k in ENV_REGISTRY if k.startswith(prefix))[:8]
            raise ValueError(f"GEM env id {id!r} is not registered" + (f"; did you mean {close}?" if close else
                                                                        f"; e.g. {sorted(ENV_REGISTRY)[:6]}"))
        unknown = [w for w in wrappers if w not in WRAPPER_FACTORY]
        if unknown:
            raise ValueError(f"GEM wrappers {unknown} are unknown; known: {sorted(WRAPPER_FACTORY)}")
        if make_args is not None and not isinstance(make_args, dict):
            raise ValueError(f"env.args.make_args must be a map of gem.make arguments, got {make_args!r}")

    def _make(self) -> Any:
        from gem.wrappers.wrapper_factory import WRAPPER_FACTORY

        env = _gem().make(self.id, **self.make_args)
        for w in self.wrappers:
            env = WRAPPER_FACTORY[w](env)
        return env

    def _to_action(self, text: str) -> Any:
        return text
