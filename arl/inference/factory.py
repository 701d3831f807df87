"""The inference backends by name (`inference.backend`): each builder takes the model directory and the whole
`inference` section and returns the engine one inference server serves with.

A user backend registers a builder with the same signature (`BACKENDS.register(name, builder)`) in a module
passed via `imports=[...]`; `arl.config.validate` checks the configured name against this registry. The registry
itself is `arl.api.registry.INFERENCE_BACKENDS`, where the built-in names below are bound to these builders.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from arl.api.engine import InferenceEngine
from arl.api.registry import INFERENCE_BACKENDS, Registry
from arl.config import InferenceConfig, LoraConfig


class BackendBuilder(Protocol):
    """With ``learner.lora`` on (only for the backends in `arl.config.LORA_INFERENCE_BACKENDS`), also
    ``lora=`` (the `LoraConfig`) and ``adapters_keep=`` (eta + 1: adapter versions a server keeps loaded)."""

    def __call__(self, model_path: str, inference: InferenceConfig, *, seed: int, index: int,
                 run_dir: str) -> InferenceEngine: ...


BACKENDS: Registry[BackendBuilder] = INFERENCE_BACKENDS


def server_seed(seed: int, index: int) -> int:
    """Sampling seed of inference server `index` in a run seeded `seed` (distinct per server)."""
    return seed * 1000 + index


def _torch_engine(model_path: str, inference: InferenceConfig, *, seed: int, index: int, run_dir: str,
                  named_policies: int = 0, named_rank: int = 0, **lora: Any) -> InferenceEngine:
    """The embedded PyTorch engine on `inference.device`, the model in `inference.dtype` (LoRA needs nothing at
    build: adapter payloads are merged when loaded). `named_policies` served beside the run's own (frozen LoRA
    policies, `policies:`): that many adapter slots plus one for the run's own adapter, of the larger rank."""
    import torch

    from arl.inference.torch_engine import TorchEngine
    from arl.models.tiny import load_model_dir, stop_token_ids

    model, tok = load_model_dir(model_path, dtype=getattr(torch, str(inference.dtype)))
    # every eos of the folder (tokenizer + generation config), as SGLang and transformers stop on them all
    engine = TorchEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=stop_token_ids(model_path),
                         max_batch_size=inference.max_batch_size, max_context_len=inference.max_context_len,
                         device=inference.device, version=0, seed=server_seed(seed, index), name=f"inference{index}",
                         prefix_cache_tokens=inference.torch.prefix_cache_tokens,
                         lean_forward=inference.torch.lean_forward,
                         max_loras=named_policies + 1 if named_policies else 0,
                         max_lora_rank=max(named_rank, lora["lora"].rank if lora.get("lora") else 0, 1))
    engine.start()
    return engine


def _sim_engine(model_path: str, inference: InferenceConfig, *, seed: int, index: int,
                run_dir: str, **_lora: Any) -> InferenceEngine:
    """The simulated engine (benchmarks): no model is loaded; `inference.sim` is its latency/length model, and the
    run seed keys its workload, so a session gets the same outputs on every server."""
    from arl.inference.sim_engine import SimEngine

    return SimEngine(inference.sim, max_batch_size=inference.max_batch_size,
                     max_context_len=inference.max_context_len, seed=server_seed(seed, index), workload_seed=seed,
                     name=f"inference{index}")


def _sglang_engine(model_path: str, inference: InferenceConfig, *, seed: int, index: int,
                   run_dir: str, lora: Optional[LoraConfig] = None, adapters_keep: int = 0, named_policies: int = 0,
                   named_rank: int = 0, named_targets: Sequence[str] = ()) -> InferenceEngine:
    """Launch and supervise this server's SGLang process (blocks until it is healthy); see launch_sglang_engine.
    With `lora`, the server loads each version's adapter (``--enable-lora``, at most `adapters_keep` kept)."""
    from arl.inference.sglang_engine import launch_sglang_engine

    adapters = {} if lora is None else {
        "lora_rank": max(lora.rank, named_rank), "adapters_keep": adapters_keep, "extra_adapters": named_policies,
        "lora_targets": sorted({*lora.target_modules, *named_targets})}
    return launch_sglang_engine(inference.sglang, model_path=model_path, device=inference.device,
                                seed=server_seed(seed, index), name=f"inference{index}", index=index,
                                run_dir=run_dir, max_batch_size=inference.max_batch_size,
                                max_context_len=inference.max_context_len, **adapters)


def build_engine(model_path: str, inference: InferenceConfig, *, seed: int, index: int = 0,
                 run_dir: str = "", lora: Optional[LoraConfig] = None, adapters_keep: int = 0,
                 named: tuple[int, int, Sequence[str]] = (0, 0, ())) -> InferenceEngine:
    """The engine of inference server `index` for `inference.backend` (an unknown name lists the registered ones).
    `lora` (when enabled) and `adapters_keep` reach the builder only when LoRA is on; `named` (how many frozen
    LoRA policies it serves beside the run's own, their largest rank and the modules they adapt) only when there
    are such policies (`policies:`, built-in backends torch and sglang)."""
    extra: dict[str, Any] = {"lora": lora, "adapters_keep": adapters_keep} if lora is not None and lora.enabled else {}
    if named[0]:
        extra.update(named_policies=named[0], named_rank=named[1])
        if inference.backend == "sglang":
            extra["named_targets"] = list(named[2])
    return BACKENDS.get(inference.backend)(model_path, inference, seed=seed, index=index, run_dir=run_dir, **extra)
