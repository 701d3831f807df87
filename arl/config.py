"""Experiment configuration: dataclasses merged with `key=value` command-line overrides through omegaconf.

Every field carries its help text in `metadata["help"]`, which `--help` prints. Errors name the offending key
(with close matches for typos) instead of showing a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
from typing import Any, Optional, Sequence

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError


def field(default: Any = MISSING, help: str = "", factory: Any = None) -> Any:
    md = {"help": help}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=md)
    return dataclasses.field(default=default, metadata=md)


@dataclasses.dataclass
class ModelConfig:
    path: str = field("", "HF model directory. Empty: build the tiny char-level Llama and warm it up (cached).")
    cache_dir: str = field("~/.cache/arl", "Where the built-in tiny model's warm-up checkpoint is cached.")
    warmup_target_acc: float = field(0.30, "Warm-up stops at this greedy test accuracy (tiny model only).")
    warmup_max_steps: int = field(600, "Upper bound on supervised warm-up steps (tiny model only).")


@dataclasses.dataclass
class DatasetConfig:
    name: str = field("arith", "'arith' (built-in a+b task) or 'jsonl' (rows with id, prompt|messages, answer).")
    train_path: str = field("", "jsonl training file (name=jsonl).")
    test_path: str = field("", "jsonl held-out file (name=jsonl).")
    max_operand: int = field(49, "arith: operands are drawn from 0..max_operand.")
    test_size: int = field(200, "arith: number of held-out pairs.")


@dataclasses.dataclass
class GenerationArgs:
    max_new_tokens: int = field(8, "New tokens per turn.")
    min_new_tokens: int = field(0, "Stop tokens are masked until this many tokens were generated.")
    temperature: float = field(1.0, "Sampling temperature (the learner recomputes logprobs at the same one).")
    top_p: float = field(1.0, "Nucleus sampling threshold.")
    top_k: int = field(0, "Top-k sampling; 0 disables.")


@dataclasses.dataclass
class AgentConfig:
    name: str = field("math-multi-turn", "Registered agent name (register_agent).")
    group_size: int = field(8, "Trajectories per prompt (the group of group-normalised advantages).")
    args: dict[str, Any] = field(help="Extra keyword arguments for the agent's constructor.", factory=dict)


@dataclasses.dataclass
class EnvConfig:
    name: str = field("math", "Registered environment name (register_env).")
    args: dict[str, Any] = field(help="Extra keyword arguments for the environment's constructor.", factory=dict)


@dataclasses.dataclass
class InferenceConfig:
    backend: str = field("torch", "Engine backend: 'torch' (embedded PyTorch engine).")
    num_workers: int = field(1, "Number of inference worker processes.")
    max_batch_size: int = field(256, "Most sequences decoded together in one step.")
    max_context_len: int = field(256, "Prompt + generated tokens limit; longer prompts are refused.")
    device: str = field("cpu", "torch device of the embedded engine.")
    threads: int = field(0, "torch threads per worker; 0 = share the cores between roles.")


@dataclasses.dataclass
class RolloutConfig:
    num_workers: int = field(1, "Number of rollout (agent) worker processes.")
    max_concurrent_rollouts: int = field(64, "Most prompt groups running at once, over all rollout workers.")
    trajectory_timeout: float = field(120.0, "Seconds one collect_trajectory may take before it is dropped.")
    request_timeout: float = field(60.0, "Seconds one generate request may wait for its response.")


@dataclasses.dataclass
class LearnerConfig:
    batch_size: int = field(16, "B: prompt groups per training step.")
    lr: float = field(1e-4, "AdamW learning rate.")
    betas: list[float] = field(help="AdamW betas.", factory=lambda: [0.9, 0.99])
    weight_decay: float = field(0.0, "AdamW weight decay.")
    grad_clip: float = field(1.0, "Gradient clipping norm (DeepSpeed gradient_clipping).")
    zero_stage: int = field(0, "DeepSpeed ZeRO stage (0-3).")
    offload_optimizer: bool = field(False, "DeepSpeed: offload optimizer states to CPU.")
    bf16: bool = field(False, "Train in bf16.")
    max_tokens_per_mb: int = field(4096, "Token budget of one micro-batch.")
    eps_clip: float = field(0.2, "PPO clip range.")
    behav_imp_weight_cap: float = field(5.0, "Decoupled PPO: tokens with behaviour weight above this are masked.")
    naive_ppo: bool = field(False, "Use standard PPO against behaviour logprobs (staleness ablation).")
    adv_std_norm: bool = field(True, "Divide group advantages by the group std.")
    threads: int = field(0, "torch threads of the learner; 0 = share the cores between roles.")
    keep_weight_versions: int = field(3, "Exported weight files kept in the run directory.")


@dataclasses.dataclass
class EvalConfig:
    every_n_steps: int = field(25, "Greedy evaluation on the held-out split every N steps (0: only start/end).")
    max_prompts: int = field(200, "Held-out prompts per evaluation (0: all).")
    concurrency: int = field(64, "Evaluation prompts in flight at once.")


@dataclasses.dataclass
class ExperimentConfig:
    experiment: str = field("async-ppo-math", "Registered experiment name.")
    run_dir: str = field("runs", "Parent directory of run directories.")
    run_name: str = field("", "Run directory name; empty: experiment name + timestamp.")
    seed: int = field(1, "Global seed.")
    total_train_steps: int = field(400, "Learner steps in the run.")
    max_head_offpolicyness: int = field(2, "eta: the most policy versions a consumed token may lag behind.")
    imports: list[str] = field(help="Modules every role imports at start-up (user agents/envs).", factory=list)
    startup_timeout: float = field(300.0, "Seconds the roles may take to start and register.")
    progress: bool = field(True, "Show a progress bar.")
    model: ModelConfig = field(factory=ModelConfig)
    dataset: DatasetConfig = field(factory=DatasetConfig)
    gen: GenerationArgs = field(factory=GenerationArgs)
    agent: AgentConfig = field(factory=AgentConfig)
    env: EnvConfig = field(factory=EnvConfig)
    inference: InferenceConfig = field(factory=InferenceConfig)
    rollout: RolloutConfig = field(factory=RolloutConfig)
    learner: LearnerConfig = field(factory=LearnerConfig)
    eval: EvalConfig = field(factory=EvalConfig)


class ConfigError(ValueError):
    """A user-facing configuration problem; the CLI prints it without a traceback."""


def _all_keys(cls: type) -> list[str]:
    keys = [k for k, *_ in _field_rows(cls())]
    groups = {k.rsplit(".", 1)[0] for k in keys if "." in k}
    return keys + sorted(groups)


def _field_rows(obj: Any, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    rows = []
    for f in dataclasses.fields(obj):
        val = getattr(obj, f.name)
        if dataclasses.is_dataclass(val):
            rows += _field_rows(val, prefix + f.name + ".")
        else:
            tname = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            rows.append((prefix + f.name, str(tname), val, f.metadata.get("help", "")))
    return rows


def format_help(config_cls: type = ExperimentConfig) -> str:
    lines = [
        "usage: python training/main_async_ppo.py [experiment=NAME] [key=value ...] [a.b.c=value ...]",
        "",
        f"Fields of {config_cls.__name__} (key: type = default  help):",
    ]
    for key, tname, default, help_text in _field_rows(config_cls()):
        lines.append(f"  {key}: {tname} = {default!r}\n      {help_text}")
    return "\n".join(lines)


def _close_matches(key: str, cls: type) -> list[str]:
    keys = _all_keys(cls)
    leaf = key.split(".")[-1]
    matches = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    matches += [k for k in difflib.get_close_matches(leaf, [k.split(".")[-1] for k in keys], n=3, cutoff=0.75)
                for k in [k2 for k2 in keys if k2.split(".")[-1] == k] if k not in matches]
    return list(dict.fromkeys(matches))[:5]


def split_experiment(argv: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """Pull `experiment=NAME` out of argv (it selects the dataclass the rest is merged into)."""
    name, rest = None, []
    for a in argv:
        if a.startswith("experiment="):
            name = a.split("=", 1)[1]
        else:
            rest.append(a)
    return name, rest


def parse_overrides(config_cls: type, overrides: Sequence[str], base: Any = None) -> Any:
    """Merge `key=value` overrides into `config_cls` defaults; returns a plain dataclass instance."""
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"arguments must look like key=value, got {bad}")
    schema = OmegaConf.structured(base if base is not None else config_cls)
    try:
        cli = OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(f"could not parse arguments {list(overrides)}: {e}") from None
    try:
        merged = OmegaConf.merge(schema, cli)
    except (ConfigKeyError, ConfigAttributeError) as e:
        key = getattr(e, "full_key", None) or str(e)
        given = [o.split("=", 1)[0] for o in overrides]
        key = next((g for g in given if g == key or g.startswith(key + ".")), key)
        hint = _close_matches(key, config_cls)
        msg = f"unknown config key '{key}'"
        if hint:
            msg += f"; did you mean: {', '.join(hint)}?"
        raise ConfigError(msg + " (see --help for every field)") from None
    except ValidationError as e:
        key = getattr(e, "full_key", "?")
        expected = _expected_type(config_cls, key)
        raise ConfigError(f"bad value for '{key}': expected {expected} ({e.msg.splitlines()[0]})") from None
    obj = OmegaConf.to_object(merged)
    validate(obj)
    return obj


def _expected_type(cls: type, key: str) -> str:
    for k, tname, _default, _help in _field_rows(cls()):
        if k == key:
            return tname
    return "a different type"


def validate(cfg: Any) -> None:
    """Cross-field checks that types alone cannot express."""
    if not isinstance(cfg, ExperimentConfig):
        return
    checks = [
        (cfg.total_train_steps >= 1, "total_train_steps must be >= 1"),
        (cfg.max_head_offpolicyness >= 0, "max_head_offpolicyness must be >= 0"),
        (cfg.learner.batch_size >= 1, "learner.batch_size must be >= 1"),
        (cfg.agent.group_size >= 1, "agent.group_size must be >= 1"),
        (cfg.inference.num_workers >= 1, "inference.num_workers must be >= 1"),
        (cfg.rollout.num_workers >= 1, "rollout.num_workers must be >= 1"),
        (cfg.rollout.max_concurrent_rollouts >= 1, "rollout.max_concurrent_rollouts must be >= 1"),
        (0 <= cfg.learner.zero_stage <= 3, "learner.zero_stage must be in 0..3"),
        (cfg.gen.max_new_tokens >= 1, "gen.max_new_tokens must be >= 1"),
        (cfg.dataset.name in ("arith", "jsonl"), f"dataset.name must be 'arith' or 'jsonl', got {cfg.dataset.name!r}"),
    ]
    from arl.inference.factory import BACKENDS

    checks.append((cfg.inference.backend in BACKENDS,
                   f"inference.backend must be one of {sorted(BACKENDS)}, got {cfg.inference.backend!r}"))
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


def import_user_modules(modules: Sequence[str]) -> None:
    """Import the modules named in `imports=[...]` (their register_* calls run in this process)."""
    import sys

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - report any import failure as a config problem
            raise ConfigError(f"imports: could not import module {m!r}: {type(e).__name__}: {e}") from None


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def load_yaml(path: str, config_cls: type) -> Any:
    schema = OmegaConf.structured(config_cls)
    return OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.load(path)))


def resolve_threads(cfg: ExperimentConfig, role: str) -> int:
    """torch threads for a role: its own setting, or the cores split between the compute-heavy roles."""
    explicit = {"inference": cfg.inference.threads, "learner": cfg.learner.threads}.get(role, 1)
    if explicit:
        return explicit
    cores = os.cpu_count() or 1
    heavy = cfg.inference.num_workers + 1  # inference workers + learner
    return max(1, cores // heavy)


__all__ = [
    "ExperimentConfig", "ConfigError", "parse_overrides", "split_experiment", "format_help", "import_user_modules",
    "to_yaml", "load_yaml", "resolve_threads", "DictConfig",
]
