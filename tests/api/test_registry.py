"""Registries bind a name lazily to "module:attribute" (so config can check backend names without importing a role),
and every built-in lazy entry resolves to what its registry holds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from arl.api.registry import INFERENCE_BACKENDS, LEARNER_BACKENDS, TRACKERS, Registry, RegistryError


def test_a_lazy_entry_is_named_at_once_and_imported_on_first_get() -> None:
    r: Registry = Registry("widget")
    r.register_lazy("dumps", "json:dumps")
    r.register("eager", len)
    assert "dumps" in r and r.names() == ["dumps", "eager"]
    import json

    assert r.get("dumps") is json.dumps and r.get("dumps") is json.dumps
    with pytest.raises(RegistryError, match="'dumps' is already registered"):
        r.register("dumps", repr)
    with pytest.raises(RegistryError, match="'eager' is already registered"):
        r.register_lazy("eager", "json:loads")
    with pytest.raises(ValueError, match="module:attribute"):
        r.register_lazy("bad", "json.dumps")
    with pytest.raises(RegistryError, match=r"unknown widget 'nope'; registered widgets: \['dumps', 'eager'\]"):
        r.get("nope")


def test_a_lazy_entry_cannot_be_replaced_before_it_is_imported() -> None:
    r: Registry = Registry("widget")
    r.register_lazy("dumps", "json:dumps")
    with pytest.raises(RegistryError, match="'dumps' is already registered \\(to 'json:dumps'\\)"):
        r.register("dumps", repr)


def test_every_builtin_backend_resolves() -> None:
    from arl.inference.factory import BACKENDS
    from arl.learner.backends import LearnerBackend
    from arl.report.trackers import TrackerEntry
    from arl.tools.base import TOOLS, Tool

    assert BACKENDS is INFERENCE_BACKENDS and INFERENCE_BACKENDS.names() == ["sglang", "sim", "torch"]
    assert all(callable(INFERENCE_BACKENDS.get(n)) for n in INFERENCE_BACKENDS.names())
    assert {n: LEARNER_BACKENDS.get(n).trains_model for n in LEARNER_BACKENDS.names()} == {"deepspeed": True,
                                                                                         "sim": False}
    assert all(isinstance(LEARNER_BACKENDS.get(n), LearnerBackend) for n in LEARNER_BACKENDS.names())
    assert TRACKERS.names() == ["mlflow", "tensorboard", "wandb"]
    assert all(isinstance(TRACKERS.get(n), TrackerEntry) for n in TRACKERS.names())
    assert {"calculator", "python"} <= set(TOOLS.names())
    assert isinstance(TOOLS.get("calculator")(), Tool)


def test_config_checks_backend_names_without_importing_a_role() -> None:
    """config sits below the roles: validating the default config imports none of their packages (nor torch)."""
    code = ("import sys\n"
            "from arl.config import ExperimentConfig, parse_overrides\n"
            "parse_overrides(ExperimentConfig, ['loggers=[jsonl,tensorboard]'])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['arl', 'inference'], ['arl', 'learner'],"
            " ['arl', 'report'], ['arl', 'rollout']) or m == 'torch'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
