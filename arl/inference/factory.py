"""Builds the inference engine a worker serves with, by backend name (`inference.backend`)."""

from __future__ import annotations

from typing import Any, Callable

from arl.api.engine import InferenceEngine


def _torch_engine(*, model_path: str, device: str, max_batch_size: int, max_context_len: int, seed: int,
                  name: str, **_: Any) -> InferenceEngine:
    from arl.inference.torch_engine import TorchEngine
    from arl.models.tiny import load_model_dir

    model, tok = load_model_dir(model_path)
    model.to(device).eval()
    engine = TorchEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         max_batch_size=max_batch_size, max_context_len=max_context_len, device=device,
                         version=0, seed=seed, name=name)
    engine.start()
    return engine


BACKENDS: dict[str, Callable[..., InferenceEngine]] = {"torch": _torch_engine}


def build_engine(backend: str, **kwargs: Any) -> InferenceEngine:
    try:
        factory = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown inference backend {backend!r}; known: {sorted(BACKENDS)}") from None
    return factory(**kwargs)
