"""`python training/main_async_ppo.py [experiment=NAME] key=value ...` — parse, validate, run."""

from __future__ import annotations

import json
import logging
import sys
from typing import Optional, Sequence

from omegaconf import OmegaConf

from arl.config import ConfigError, format_help, import_user_modules, parse_overrides, split_experiment


def _early_imports(argv: Sequence[str]) -> list[str]:
    """`imports=[...]` must be honoured before parsing: those modules may register the experiment itself."""
    for a in argv:
        if a.startswith("imports="):
            try:
                val = OmegaConf.to_container(OmegaConf.from_dotlist([a]))["imports"]
            except Exception as e:  # noqa: BLE001
                raise ConfigError(f"could not parse {a!r}: {e}") from None
            return [str(m) for m in (val if isinstance(val, list) else [val])]
    return []


def load_config(argv: Sequence[str], experiments: Sequence[str] = ()):
    """The run's config from `argv`, merged into the class of the experiment it names.

    `experiments`: modules that register experiments (the built-in ones are passed by the entry point; the library
    does not import them). The chosen experiment's module joins `imports`, so every role process imports it and
    reads config.yaml with the same class (a user experiment may add fields).
    """
    name, rest, cls = _experiment(argv, experiments)
    cfg = parse_overrides(cls, rest)
    cfg.experiment = name or cfg.experiment
    if cls.__module__ not in cfg.imports and cls.__module__ != "__main__":
        cfg.imports = [cls.__module__, *cfg.imports]
    return cfg


def _experiment(argv: Sequence[str], experiments: Sequence[str]) -> tuple[Optional[str], list[str], type]:
    """The `experiment=NAME` of `argv` (None: not given), the rest of `argv`, and the experiment's config class,
    after the builtins, `experiments` and the early imports registered what they define."""
    from arl.api.registry import EXPERIMENTS
    from arl.builtin import load_builtins

    load_builtins()
    import_user_modules([*experiments, *_early_imports(argv)])
    name, rest = split_experiment(argv)
    return name, rest, EXPERIMENTS.get(name or "async-ppo-math")


def main(argv: Optional[Sequence[str]] = None, experiments: Sequence[str] = ()) -> int:
    """`experiments`: modules registering the experiments to choose from (see load_config)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        from arl.api.registry import EXPERIMENTS

        print(format_help(_experiment(argv, experiments)[2]))
        print(f"\nregistered experiments: {EXPERIMENTS.names()}")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from arl.api.registry import RegistryError

    try:
        cfg = load_config(argv, experiments)
        from arl.launch.run import RunFailed, check_names, run_experiment

        check_names(cfg)
    except (ConfigError, RegistryError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        summary = run_experiment(cfg)
    except RunFailed as e:
        print(f"\nrun failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; every role stopped", file=sys.stderr)
        return 130
    print(json.dumps(summary, indent=1, default=str))
    return 0
