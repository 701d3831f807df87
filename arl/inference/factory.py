"""Builds the inference engine a worker serves with, by backend name (`inference.backend`)."""

from __future__ import annotations

from typing import Any, Callable

from arl.api.engine import InferenceEngine


def _torch_engine(*, model_path: str, device: str, max_batch_size: int, max_context_len: int, seed: int,
                  name: str, **_: Any) -> InferenceEngine:
    from arl.inference.torch_engine import TorchEngine
    from arl.models.tiny import load_model_dir, stop_token_ids

    model, tok = load_model_dir(model_path)
    model.to(device).eval()
    # every eos of the folder (tokenizer + generation config), as SGLang and transformers stop on them all
    engine = TorchEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=stop_token_ids(model_path),
                         max_batch_size=max_batch_size, max_context_len=max_context_len, device=device,
                         version=0, seed=seed, name=name)
    engine.start()
    return engine


def _sim_engine(*, max_batch_size: int, max_context_len: int, seed: int, name: str,
                sim: dict[str, Any] | None = None, **_: Any) -> InferenceEngine:
    """The simulated engine (benchmarks): no model is loaded; `sim` holds SimEngine's latency/length settings."""
    from arl.inference.sim_engine import SimEngine

    return SimEngine(max_batch_size=max_batch_size, max_context_len=max_context_len, seed=seed, name=name,
                     **(sim or {}))


def _sglang_engine(*, model_path: str, device: str, max_batch_size: int, max_context_len: int, seed: int,
                   name: str, index: int = 0, run_dir: str = "", sglang: dict[str, Any] | None = None,
                   **_: Any) -> InferenceEngine:
    """Launch and supervise this worker's SGLang server (blocks until it is healthy); `sglang` holds the
    `inference.sglang_*` settings (see launch_sglang_engine)."""
    from arl.inference.sglang_engine import launch_sglang_engine

    return launch_sglang_engine(model_path=model_path, device=device, seed=seed, name=name, index=index,
                                run_dir=run_dir, max_batch_size=max_batch_size, max_context_len=max_context_len,
                                **(sglang or {}))


BACKENDS: dict[str, Callable[..., InferenceEngine]] = {"torch": _torch_engine, "sim": _sim_engine,
                                                      "sglang": _sglang_engine}


def build_engine(backend: str, **kwargs: Any) -> InferenceEngine:
    try:
        factory = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown inference backend {backend!r}; known: {sorted(BACKENDS)}") from None
    return factory(**kwargs)
