"""Name -> object registries: agents, environments, experiments, inference and learner backends and loggers (here),
tools and tool-call parsers (`arl.tools`). One mechanism, one error for an unknown name.

Users call `register_agent` in their own module and pass `imports=[module]` so every role process imports it.

Why the backend registries live here and not beside their builders: `arl.config` checks a configured name against
them, and config sits below the roles (docs/architecture.md, .importlinter). A built-in backend is registered by
where it lives ("module:attribute", `register_lazy`) and imported on first `get`, so reading the names imports no
role, no torch and no DeepSpeed.
"""

from __future__ import annotations

import importlib
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
        self._lazy: dict[str, str] = {}  # name -> "module:attribute", imported on first get

    def register(self, name: str, obj: T) -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._lazy or (name in self._items and self._items[name] is not obj):
            raise RegistryError(f"{self.kind} {name!r} is already registered (to "
                                f"{self._lazy.get(name) or self._items[name]!r}); registered {self.kind}s: "
                                f"{self.names()}")
        self._items[name] = obj
        return obj

    def register_lazy(self, name: str, target: str) -> None:
        """Register `name` as the object at `target` ("package.module:attribute"), imported on first `get`."""
        module, sep, attribute = target.partition(":")
        if not (isinstance(name, str) and name and module and sep and attribute):
            raise ValueError(f"{self.kind}: register_lazy needs a name and 'module:attribute', got {name!r}, "
                             f"{target!r}")
        if name in self:
            raise RegistryError(f"{self.kind} {name!r} is already registered; registered {self.kind}s: "
                                f"{self.names()}")
        self._lazy[name] = target

    def get(self, name: str) -> T:
        if name not in self:
            raise RegistryError(self.unknown(name))
        if name in self._lazy:
            module, _, attribute = self._lazy[name].partition(":")
            self._items[name] = getattr(importlib.import_module(module), attribute)
            del self._lazy[name]
        return self._items[name]

    def unknown(self, name: object) -> str:
        """The message for a name that is not registered (also used by config validation)."""
        return (f"unknown {self.kind} {name!r}; registered {self.kind}s: {self.names()}"
                f" (register one with {self.how} in a module passed via imports=[...])")

    def names(self) -> list[str]:
        return sorted([*self._items, *self._lazy])

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._items or name in self._lazy)


AGENTS: Registry[Any] = Registry("agent", "register_agent(name, cls)")
ENVS: Registry[Any] = Registry("env", "register_env(name, cls)")
EXPERIMENTS: Registry[Any] = Registry("experiment", "register_experiment(name, config_cls)")

# `inference.backend`: builder(model_path, inference section, *, seed, index, run_dir) -> InferenceEngine
# (`arl.inference.factory.BackendBuilder`; `arl.inference.factory.BACKENDS` is this registry)
INFERENCE_BACKENDS: Registry[Any] = Registry("inference backend",
                                             "arl.inference.factory.BACKENDS.register(name, builder)")
INFERENCE_BACKENDS.register_lazy("torch", "arl.inference.factory:_torch_engine")
INFERENCE_BACKENDS.register_lazy("sim", "arl.inference.factory:_sim_engine")
INFERENCE_BACKENDS.register_lazy("sglang", "arl.inference.factory:_sglang_engine")

# `learner.backend`: `arl.learner.backends.LearnerBackend` (how to build the engine, whether it trains a model)
LEARNER_BACKENDS: Registry[Any] = Registry("learner_backend")
LEARNER_BACKENDS.register_lazy("deepspeed", "arl.learner.backends:DEEPSPEED")
LEARNER_BACKENDS.register_lazy("sim", "arl.learner.backends:SIM")

# `loggers`: `arl.report.trackers.TrackerEntry` (make the tracker, the package it needs); "jsonl" is always on
TRACKERS: Registry[Any] = Registry("logger", "TRACKERS.register(name, TrackerEntry(make, package))")
TRACKERS.register_lazy("tensorboard", "arl.report.trackers:TENSORBOARD")
TRACKERS.register_lazy("wandb", "arl.report.trackers:WANDB")
TRACKERS.register_lazy("mlflow", "arl.report.trackers:MLFLOW")


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
