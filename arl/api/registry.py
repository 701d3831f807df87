"""Name -> object registries: agents, environments, experiments (here), tools and tool-call parsers
(`arl.tools`), inference backends (`arl.inference.factory`). One mechanism, one error for an unknown name.

Users call `register_agent` in their own module and pass `imports=[module]` so every role process imports it.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; users should read it plainly
        return str(self.args[0])


class Registry(Generic[T]):
    """Names of one kind of object (`kind`, e.g. "agent"). `how` says how a user registers one; the error for an
    unknown name lists the registered names and repeats it."""

    def __init__(self, kind: str, how: str = "") -> None:
        self.kind = kind
        self.how = how or f"{kind.replace(' ', '_').upper()}S.register(name, obj)"
        self._items: dict[str, T] = {}

    def register(self, name: str, obj: T) -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items and self._items[name] is not obj:
            raise RegistryError(f"{self.kind} {name!r} is already registered (to {self._items[name]!r}); "
                                f"registered {self.kind}s: {self.names()}")
        self._items[name] = obj
        return obj

    def get(self, name: str) -> T:
        if name not in self:
            raise RegistryError(self.unknown(name))
        return self._items[name]

    def unknown(self, name: object) -> str:
        """The message for a name that is not registered (also used by config validation)."""
        return (f"unknown {self.kind} {name!r}; registered {self.kind}s: {self.names()}"
                f" (register one with {self.how} in a module passed via imports=[...])")

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items


AGENTS: Registry[Any] = Registry("agent", "register_agent(name, cls)")
ENVS: Registry[Any] = Registry("env", "register_env(name, cls)")
EXPERIMENTS: Registry[Any] = Registry("experiment", "register_experiment(name, config_cls)")


def register_agent(name: str, cls: Any) -> Any:
    return AGENTS.register(name, cls)


def register_env(name: str, cls: Any) -> Any:
    return ENVS.register(name, cls)


def register_experiment(name: str, config_cls: Any) -> Any:
    return EXPERIMENTS.register(name, config_cls)


def make_agent(name: str, **kwargs: Any) -> Any:
    return AGENTS.get(name)(**kwargs)


def make_env(name: str, **kwargs: Any) -> Any:
    return ENVS.get(name)(**kwargs)
