"""PPO objective pieces as pure functions: tensors in, tensors out (no DeepSpeed, no model, no state).

Conventions shared with `arl.learner.batching`:

- Per-token tensors are *aligned with the input tokens*: position ``t`` holds the quantity that belongs to token
  ``input_ids[t]`` (its log-probability given ``input_ids[:t]``, its behaviour logprob, its version, its
  advantage). That is the layout of `arl.api.types.Trajectory`, so trajectory arrays need no shifting; the single
  shift between "logits at position t-1" and "token at position t" lives in `token_logprobs` (and
  `shift_right`). Position 0 has no prefix, so it never carries a logprob (value 0) and must never be in a loss mask.
- Masks are bool (or 0/1) tensors of the same shape as the values; masked-out positions may hold any finite value.

The loss is AReaL's decoupled PPO (Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
Language Reasoning", 2025; `ppo_actor_loss_fn` in AReaL), aggregated as a token-level mean.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "group_advantages",
    "decoupled_ppo_loss",
    "token_logprobs",
    "entropy_from_logits",
    "shift_right",
    "masked_mean",
]


def masked_mean(x: Tensor, mask: Tensor, denominator: Optional[float | Tensor] = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is set, divided by ``denominator`` (default: the number of set positions, min 1)."""
    mask = mask.bool()
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    if denominator is None:
        denominator = mask.sum().clamp(min=1)
    return total / denominator


def group_advantages(
    rewards: Tensor,
    group_ids: Sequence[str],
    *,
    std_norm: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO advantages: each reward minus the mean reward of its group, optionally divided by (group std + eps).

    Args:
        rewards: float tensor ``[N]``, one scalar reward per sequence.
        group_ids: ``N`` hashable ids; sequences sharing an id were sampled from the same prompt.
        std_norm: divide by the group's standard deviation (population std, ``unbiased=False``) plus ``eps``.
            A group whose rewards are all equal gets advantages 0 either way; a group of one sequence gets 0.
        eps: added to the std before dividing.

    Returns:
        float tensor ``[N]`` (same dtype/device as ``rewards``; integer rewards are promoted to float32).
    """
    rewards = rewards.reshape(-1)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if len(group_ids) != rewards.numel():
        raise ValueError(f"group_ids has {len(group_ids)} entries but rewards has {rewards.numel()}")
    index: dict[str, int] = {}
    gid = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long, device=rewards.device)
    n_groups = len(index)
    count = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, gid, torch.ones_like(rewards)
    )
    mean = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, gid, rewards) / count
    centred = rewards - mean[gid]
    if not std_norm:
        return centred
    var = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, gid, centred**2) / count
    return centred / (var.sqrt()[gid] + eps)


def decoupled_ppo_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_clip: float = 0.2,
    behav_imp_weight_cap: Optional[float] = 5.0,
    naive: bool = False,
    denominator: Optional[float | Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL's decoupled PPO policy loss, token-level mean.

    With ``r = exp(logp - prox_logp)`` and ``w = exp(prox_logp - behav_logp)`` (no gradient through ``w``)::

        loss_t = w_t * max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_clip, 1 + eps_clip))   # = -w * min(r A, clip(r) A)
        loss   = sum_{t in mask, w_t <= cap} loss_t / denominator

    Cap semantics (same as AReaL's ``ppo_actor_loss_fn``): ``behav_imp_weight_cap`` is a **filter, not a clamp**.
    A token whose behaviour weight exceeds the cap contributes 0 to the numerator but still counts in the
    denominator (AReaL divides by the loss-mask count taken before the filter), so capping never rescales the
    other tokens. ``None`` disables the filter. ``w == cap`` is kept.

    ``naive=True`` is standard PPO with the behaviour policy as the old policy: ``r = exp(logp - behav_logp)``, no
    behaviour weight and no cap (``prox_logp`` is ignored and may be None). This is what AReaL computes with
    ``use_decoupled_loss=False`` and no recomputation.

    Args:
        logp: current-policy log-probs of the taken tokens (carries the gradient).
        prox_logp: proximal-policy log-probs (the learner's weights before this update), no gradient.
        behav_logp: log-probs reported by the inference engine that sampled the tokens, no gradient.
        advantages: per-token advantages, no gradient.
        mask: which tokens are in the loss (model-generated tokens).
        eps_clip: PPO clip range.
        behav_imp_weight_cap: tokens with ``w > cap`` are dropped from the numerator; None: keep all.
        naive: see above.
        denominator: divide the masked sum by this instead of the mask count. Pass the token count of the whole
            batch when the batch is split into micro-batches, so the micro-batch losses sum to the batch's
            token-level mean.

    Returns:
        ``(loss, stats)``. ``loss`` is a scalar. ``stats`` are detached scalar tensors, each a mean over the
        masked tokens (mask count, not ``denominator``) so they can be re-weighted by ``stats["n_tokens"]``:

        - ``clip_frac``: fraction of tokens where the clipped term was the active (larger-loss) one;
        - ``imp_weight_mean``: mean behaviour weight ``w`` over uncapped tokens (1 when ``naive``);
        - ``capped_frac``: fraction of tokens dropped by the cap;
        - ``approx_kl``: mean of ``prox_logp - logp`` (``behav_logp - logp`` when naive), the k1 estimate of
          KL(old || current) on the sampled tokens;
        - ``ratio_mean``: mean PPO ratio ``r``;
        - ``n_tokens``: number of masked tokens (float).
    """
    mask = mask.bool()
    if not (logp.shape == behav_logp.shape == advantages.shape == mask.shape):
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)} behav_logp {tuple(behav_logp.shape)} "
            f"advantages {tuple(advantages.shape)} mask {tuple(mask.shape)}"
        )
    advantages = advantages.detach().to(logp.dtype)
    behav_logp = behav_logp.detach().to(logp.dtype)
    if naive:
        old_logp = behav_logp
    else:
        if prox_logp is None or prox_logp.shape != logp.shape:
            raise ValueError("decoupled loss needs prox_logp of the same shape as logp")
        old_logp = prox_logp.detach().to(logp.dtype)

    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Masked positions may hold garbage (padding): keep exp() finite there.
    log_ratio = torch.where(mask, logp - old_logp, zero)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip)
    pg1 = -advantages * ratio
    pg2 = -advantages * clipped
    pg = torch.maximum(pg1, pg2)
    clip_mask = (pg2.detach() > pg1.detach()) & mask

    if naive:
        keep = mask
        weight = torch.ones_like(pg)
    else:
        behav_log_w = torch.where(mask, old_logp - behav_logp, zero)
        weight = behav_log_w.exp()
        keep = mask if behav_imp_weight_cap is None else mask & (weight <= behav_imp_weight_cap)
        weight = torch.where(keep, weight, zero)
    loss_tok = pg * weight
    if denominator is None:
        denominator = mask.sum().clamp(min=1)
    loss = torch.where(keep, loss_tok, zero).sum() / denominator

    with torch.no_grad():
        n = mask.sum()
        n_f = n.clamp(min=1).to(torch.float32)
        n_keep = keep.sum().clamp(min=1).to(torch.float32)
        stats = {
            "clip_frac": clip_mask.sum().to(torch.float32) / n_f,
            "imp_weight_mean": torch.where(keep, weight, zero).sum().to(torch.float32) / n_keep
            if keep.any()
            else torch.ones((), dtype=torch.float32, device=logp.device),
            "capped_frac": (mask & ~keep).sum().to(torch.float32) / n_f,
            "approx_kl": torch.where(mask, -log_ratio, zero).sum().to(torch.float32) / n_f,
            "ratio_mean": torch.where(mask, ratio, zero).sum().to(torch.float32) / n_f,
            "n_tokens": n.to(torch.float32),
        }
    return loss, stats


def shift_right(x: Tensor, fill: float = 0.0) -> Tensor:
    """``out[..., 0] = fill``, ``out[..., t] = x[..., t-1]``: moves per-logit-position values onto the token they
    predict."""
    pad = torch.full_like(x[..., :1], fill)
    return torch.cat([pad, x[..., :-1]], dim=-1)


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of every token given its prefix, under ``log_softmax(logits / temperature)``.

    Args:
        logits: ``[..., T, V]`` model outputs; ``logits[..., t, :]`` is the distribution of token ``t+1``.
        input_ids: ``[..., T]`` the tokens.
        temperature: the sampling temperature the behaviour policy used (logprobs must be compared under the same
            distribution the tokens were sampled from).

    Returns:
        float32 ``[..., T]`` aligned with ``input_ids``: ``out[..., t] = log p(input_ids[t] | input_ids[:t])`` for
        ``t >= 1`` and ``out[..., 0] = 0`` (the first token has no prefix). Computed in float32 whatever the
        logits' dtype.
    """
    if logits.shape[:-1] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)} do not align")
    x = logits[..., :-1, :].float()
    if temperature != 1.0:
        x = x / temperature
    targets = input_ids[..., 1:].long().unsqueeze(-1)
    lp = x.gather(-1, targets).squeeze(-1) - torch.logsumexp(x, dim=-1)
    return torch.cat([torch.zeros_like(lp[..., :1]), lp], dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy (nats) of ``softmax(logits / temperature)`` at every logit position: ``[..., T, V] -> [..., T]``.

    Not shifted: ``out[..., t]`` is the entropy of the distribution that predicts token ``t+1``; use
    ``shift_right`` to align it with the tokens. Float32.
    """
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    logp = torch.log_softmax(x, dim=-1)
    return -(logp.exp() * logp).sum(-1)
