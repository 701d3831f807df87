"""Name -> class registries for agents, environments and experiments.

Users call `register_agent` in their own module and pass `imports=[module]` so every role process imports it.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; users should read it plainly
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, obj: T) -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items and self._items[name] is not obj:
            raise RegistryError(
                f"{self.kind} {name!r} is already registered (to {self._items[name]!r}); "
                f"registered {self.kind}s: {self.names()}"
            )
        self._items[name] = obj
        return obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise RegistryError(
                f"unknown {self.kind} {name!r}; registered {self.kind}s: {self.names()}"
                f" (register one with register_{self.kind}(name, cls) in a module passed via imports=[...])"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


AGENTS: Registry[Any] = Registry("agent")
ENVS: Registry[Any] = Registry("env")
EXPERIMENTS: Registry[Any] = Registry("experiment")


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
