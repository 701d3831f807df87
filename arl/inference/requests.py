"""Request checks shared by every engine backend (embedded torch, sim, SGLang), so they refuse the same bad
input with the same words."""

from __future__ import annotations

from typing import Collection, Optional

from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig

ENGINE_CLOSED = "engine closed"


def check_limits(max_batch_size: int, max_context_len: int) -> None:
    """The engine-side limits every embedded backend needs (one sample fits one row, one token fits the window)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if max_context_len < 2:
        raise ValueError(f"max_context_len must be >= 2, got {max_context_len}")


def refusal(req: object, error: str) -> GenerateResponse:
    """The answer to a request that is not served (bad input, or the engine closed or failed)."""
    return GenerateResponse(qid=str(getattr(req, "qid", "?")), samples=[], error=error)


def check_request(req: GenerateRequest, *, max_context_len: int = 0, vocab_size: int = 0,
                  max_batch_size: int = 0, policies: Collection[str] = ()) -> Optional[str]:
    """Why `req` cannot be served (a message for the caller's error response), or None if it can.

    A limit of 0 is not checked (e.g. an SGLang server enforces its own vocabulary). `policies`: the named
    policies the engine serves beside its own weights (a request naming another is refused). Never raises:
    anything odd about the request is the caller's input error.
    """
    try:
        policy = getattr(req, "policy", None)
        if policy is not None and policy not in policies:
            return (f"unknown policy {policy!r}: this engine serves its own weights (policy None)"
                    f"{' and ' + str(sorted(policies)) if policies else ''}")
        return _check(req, max_context_len, vocab_size, max_batch_size)
    except Exception as e:  # noqa: BLE001
        return f"invalid request: {type(e).__name__}: {e}"


def _check(req: GenerateRequest, max_context_len: int, vocab_size: int, max_batch_size: int) -> Optional[str]:
    if not isinstance(req, GenerateRequest):
        return f"expected a GenerateRequest, got {type(req).__name__}"
    g = req.gconfig
    if not isinstance(g, GenerationConfig):
        return f"gconfig must be a GenerationConfig, got {type(g).__name__}"
    try:
        g.validate()
    except ValueError as e:
        return f"invalid GenerationConfig: {e}"
    ids = req.input_ids
    if len(ids) == 0:
        return "empty prompt (input_ids has no tokens)"
    if max_context_len and len(ids) >= max_context_len:
        return (f"prompt too long: {len(ids)} tokens, the engine's max_context_len is {max_context_len} "
                f"(prompt + at least one generated token must fit)")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (vocab_size and hi >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size else ">= 0"
        return f"token id out of vocabulary range {bound}: min {lo}, max {hi}"
    if max_batch_size and g.n > max_batch_size:
        return f"n={g.n} samples exceeds the engine's max_batch_size {max_batch_size}"
    return None
