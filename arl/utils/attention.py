"""Attention kernels for shapes that change at every call.

PyTorch's cuDNN SDPA backend (the first it tries on Hopper GPUs in torch 2.11) builds a cuDNN graph for each new
(batch, heads, query length, key length, ...) and keeps it in a cache of the calling thread that is never freed.
Here shapes change all the time: continuous batching changes the batch and key widths at each decode step, a
packed learner micro-batch runs one attention per sequence at its own length, and the learner's phases run in
worker threads whose caches start empty. On the first GPU lent (one H200, 2026-11-30) the default run's learner
step took ~9 s where the same step with warm caches took 0.16 s, the learner's host memory grew ~330 MiB a step,
and the profile showed every attention call in `_cudnn_attention_forward` / `_backward`. Flash and
memory-efficient attention need no build for a new shape, so a process that runs a model on CUDA turns the cuDNN
backend off (`scripts/gpu_check.py` part f measures the step both ways).
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

KEEP_CUDNN_ENV = "ARL_CUDNN_SDPA"  # "1": leave PyTorch's cuDNN attention backend on


def avoid_per_shape_attention(device: Any) -> bool:
    """On a CUDA `device`, turn off PyTorch's cuDNN SDPA backend for this process (flash, memory-efficient and math
    attention stay); True if it was turned off. `ARL_CUDNN_SDPA=1` leaves it on."""
    import torch

    if torch.device(device).type != "cuda" or os.environ.get(KEEP_CUDNN_ENV) == "1":
        return False
    enable = getattr(torch.backends.cuda, "enable_cudnn_sdp", None)
    if enable is None:  # a torch without the cuDNN backend's switch has no such backend to avoid
        return False
    if torch.backends.cuda.cudnn_sdp_enabled():
        enable(False)
        logger.info("cuDNN attention off in this process: it builds a graph per new shape (%s=1 keeps it)",
                    KEEP_CUDNN_ENV)
    return True
