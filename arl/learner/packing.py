"""Padding-free forward passes for HF causal LMs: several sequences in one row, attention kept inside each.

How transformers 5 supports packed rows, and what this module adds:

- ``position_ids`` restarting at 0 per sequence give every sequence its own rotary positions. With
  ``attention_mask=None``, ``masking_utils.find_packed_sequence_indices`` detects the restarts and
  ``create_causal_mask`` builds a block-diagonal causal mask (sdpa/eager/flex). That is correct but dense: a
  ``[T, T]`` mask and ``T^2`` attention work for a row of ``T`` tokens, more than the padded layout costs.
- ``flash_attention_2/3`` take ``cu_seq_lens_q/k`` + ``max_length_q/k`` (`TransformersKwargs`) and run varlen
  kernels (GPU only).
- Here: an attention function registered under ``"arl_varlen"`` (`AttentionInterface.register`) that splits the row
  at ``cu_seq_lens_q`` (`packed_forward_kwargs` passes it) and runs causal SDPA on each sequence, so the work
  is ``sum(L_i^2)`` as in varlen flash attention, on any device. Its mask function returns None when there is no
  padding mask (nothing to materialise) and defers to the sdpa mask otherwise, so padded batches still work.

Rows with shared prefixes (`MicroBatch.shares_prefixes`: a GRPO group's chains share their prompt and often their
first turns) run the model on the row's prefix tree instead: each distinct prefix once, at its depth. The attention
function gets ``arl_prefix_tree`` (`packed_forward_kwargs`): per sequence, its own nodes' queries attend to the keys
of its ancestors and of its own nodes (every path gathered in one call per layer), causally (lower-right aligned). Every
sequence sees exactly the keys it would see alone, so logits and gradients are the plain packed row's (up to float
summation order: a shared node's gradient is the sum over the sequences that read it).

`enable_varlen_attention(model)` switches a model whose implementation is sdpa or eager to ``arl_varlen`` (flash
attention models keep theirs: they already read ``cu_seq_lens_*``). `packed_forward_kwargs(mb)` builds the model
keyword arguments for a packed `MicroBatch`. The attention implementation is a runtime setting, not saved by
``save_pretrained``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from arl.learner.batching import MicroBatch

__all__ = ["VARLEN_ATTENTION", "register_varlen_attention", "enable_varlen_attention", "packed_forward_kwargs"]

VARLEN_ATTENTION = "arl_varlen"


def _varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Per-sequence causal SDPA on a packed row; plain SDPA otherwise. Shapes as transformers' attention
    functions: query ``[B, H, T, D]`` in, ``[B, T, H, D]`` out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    tree = kwargs.pop("arl_prefix_tree", None)
    if tree is not None and query.shape[0] == 1 and attention_mask is None:
        return _tree_attention(module, query, key, value, tree, dropout=dropout, scaling=scaling, **kwargs), None
    cu = kwargs.pop("cu_seq_lens_q", None)
    for k in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(k, None)
    q_len = query.shape[2]
    packed_row = query.shape[0] == 1 and attention_mask is None and q_len > 1 and q_len == key.shape[2]
    if cu is None or len(cu) <= 2 or not packed_row:  # a single sequence, or not a packed row
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if int(cu[-1]) != q_len:
        raise ValueError(f"cu_seq_lens end at {int(cu[-1])} but the packed row has {q_len} tokens")
    kwargs.pop("is_causal", None)
    # split (not slicing): its backward concatenates the pieces' gradients once, where each slice's backward
    # would materialise a zero tensor of the whole row
    lens = cu.diff().tolist()
    outs = []
    for q, k, v in zip(query.split(lens, dim=2), key.split(lens, dim=2), value.split(lens, dim=2)):
        o, _ = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True,
                                      **kwargs)
        outs.append(o)
    return torch.cat(outs, dim=1), None


@functools.lru_cache(maxsize=512)
def _lower_right_causal(q_len: int, n_before: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, q_len, n_before + q_len]``: query ``j`` sees the ``n_before`` earlier keys and its own first ``j + 1``."""
    return (torch.arange(n_before + q_len, device=device)[None, :]
            <= n_before + torch.arange(q_len, device=device)[:, None])[None, None]


def _tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    tree: tuple[list[int], torch.Tensor, list[int]], **kwargs: Any) -> torch.Tensor:
    """Attention over a prefix tree's nodes (see the module doc): ``tree = (owned, paths, lengths)``, per sequence
    the number of nodes it adds, every sequence's path (its node at each position, concatenated) and its length.
    Shapes as `_varlen_attention`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    owned, paths, lengths = tree
    kwargs.pop("is_causal", None)  # set per sequence below
    # one gather per layer of every sequence's keys and values along its path: one scatter-add in the backward,
    # no per-sequence concatenation
    k_paths = key.index_select(2, paths).split(lengths, dim=2)
    v_paths = value.index_select(2, paths).split(lengths, dim=2)
    outs = []
    for q, k, v in zip(query.split(owned, dim=2), k_paths, v_paths):
        n_q, n_k = q.shape[2], k.shape[2]
        if n_q == 0:  # a sequence that is a prefix of an earlier one: nothing of its own to compute
            continue
        mask = None if n_q == n_k else _lower_right_causal(n_q, n_k - n_q, q.device)
        o, _ = sdpa_attention_forward(module, q, k, v, mask, is_causal=mask is None, **kwargs)
        outs.append(o)
    return torch.cat(outs, dim=1)


def _varlen_mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """No 2D padding mask: nothing to build (the attention function handles causality and packing). Otherwise the
    usual sdpa mask."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def register_varlen_attention() -> None:
    """Register ``arl_varlen`` with transformers' attention and mask interfaces (idempotent: a mapping update)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, _varlen_attention)
    AttentionMaskInterface.register(VARLEN_ATTENTION, _varlen_mask)


def enable_varlen_attention(model: torch.nn.Module) -> str:
    """Make ``model`` attend per sequence on packed rows; returns the implementation now in use."""
    cfg = getattr(model, "config", None)
    current = getattr(cfg, "_attn_implementation", None)
    if current is not None and str(current).startswith("flash_attention"):
        return str(current)  # varlen kernels already read cu_seq_lens_*
    register_varlen_attention()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(VARLEN_ATTENTION)
    elif cfg is not None:
        cfg._attn_implementation = VARLEN_ATTENTION
    return VARLEN_ATTENTION


def packed_forward_kwargs(mb: MicroBatch) -> dict[str, Any]:
    """Model keyword arguments for a packed micro-batch: restarting ``position_ids``, no attention mask, and the
    flash-attention varlen metadata (read by ``arl_varlen`` and by flash attention)."""
    assert mb.packed and mb.position_ids is not None and mb.cu_seqlens is not None
    if mb.shares_prefixes:
        assert mb.node_index is not None and mb.node_owned is not None
        return {"input_ids": mb.node_ids, "position_ids": mb.node_position_ids, "attention_mask": None,
                "arl_prefix_tree": (mb.node_owned.tolist(), mb.node_index, mb.seq_lens.tolist())}
    cu = mb.cu_seqlens.to(device=mb.input_ids.device, dtype=torch.int32)
    max_len = int(mb.seq_lens.max())
    return {
        "input_ids": mb.input_ids,
        "position_ids": mb.position_ids,
        "attention_mask": None,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }
