"""PPO objective pieces as pure functions: tensors in, tensors out (no DeepSpeed, no model, no state).

Conventions shared with `arl.learner.batching`:

- Per-token tensors are *aligned with the input tokens*: position ``t`` holds the quantity that belongs to token
  ``input_ids[t]`` (its log-probability given ``input_ids[:t]``, its behaviour logprob, its version, its
  advantage). That is the layout of `arl.api.types.Trajectory`, so trajectory arrays need no shifting; the single
  shift between "logits at position t-1" and "token at position t" lives in `token_logprobs` (and
  `shift_right`). Position 0 has no prefix, so it never carries a logprob (value 0) and must never be in a loss mask.
- Masks are bool (or 0/1) tensors of the same shape as the values; masked-out positions may hold any finite value.

The loss is AReaL's decoupled PPO (Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
Language Reasoning", 2025; `ppo_actor_loss_fn` in AReaL), aggregated as a token-level mean by default; per-token
weights give sequence-level aggregation (`sequence_level_weights`) and staleness down-weighting
(`stale_token_weights`). Also here: dual clip, KL to a reference (`kl_penalty`), turn-level discounting for
multi-turn rewards (`turn_segments`, `discounted_turn_returns`, `turn_level_advantages`). See docs/learner.md.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from arl.api.staleness import StalenessPolicy
from arl.config import CORRECTION_MASKS
from arl.learner.corrections import Corrections, behaviour_weight, policy_term

__all__ = ["group_advantages", "decoupled_ppo_loss", "kl_penalty", "turn_segments", "discounted_turn_returns",
           "turn_level_advantages", "sequence_level_weights", "stale_token_weights", "token_logprobs",
           "entropy_from_logits", "shift_right"]


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

    def group_mean(x: Tensor) -> Tensor:  # per sequence: the mean of x over its group
        return (rewards.new_zeros(len(index)).index_add_(0, gid, x) / count)[gid]

    count = rewards.new_zeros(len(index)).index_add_(0, gid, torch.ones_like(rewards))
    centred = rewards - group_mean(rewards)
    return centred / (group_mean(centred**2).sqrt() + eps) if std_norm else centred


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
    dual_clip_c: Optional[float] = None,
    token_weights: Optional[Tensor] = None,
    ref_logp: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k1",
    correction: Optional[Corrections] = None,
    seq_index: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL's decoupled PPO policy loss, token-level mean (or any weighting through ``token_weights``).

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
        dual_clip_c: dual-clip PPO (Ye et al. 2020): for ``A < 0`` the token loss is also bounded above by
            ``-c * A`` (``c > 1``), so a huge ratio on a bad token cannot blow the loss up. None: off.
        token_weights: per-token multipliers of the token losses (no gradient), applied before the sum. Sequence-
            level aggregation passes ``1 / tokens of the sequence`` (see `sequence_level_weights`) with
            ``denominator`` = number of sequences; staleness down-weighting multiplies in here too.
        ref_logp, kl_coef, kl_estimator: adds ``kl_coef * KL(current || reference)`` per token (estimator
            ``k1`` or ``k3``, see `kl_penalty`), aggregated with the same weights and denominator, on every masked
            token (the behaviour-weight cap does not filter it). Off when ``kl_coef == 0`` or ``ref_logp`` is None.
        correction: off-policy corrections of the behaviour weight, masks and the policy term
            (`arl.learner.corrections`); None: the decoupled loss above. ``seq_index`` (per token, its sequence)
            is needed by the sequence-level ones (seq_tis, seq_mis, geo_mask, gspo).

    Returns:
        ``(loss, stats)``. ``loss`` is a scalar. ``stats`` are detached scalar tensors, each a mean over the
        masked tokens (mask count, not ``denominator``) so they can be re-weighted by ``stats["n_tokens"]``:

        - ``clip_frac``: fraction of tokens where the clipped term was the active (larger-loss) one;
        - ``imp_weight_mean``: mean behaviour weight ``w`` over uncapped tokens (1 when ``naive``);
        - ``capped_frac``: fraction of tokens dropped by the cap or a correction's mask;
        - ``approx_kl``: mean of ``prox_logp - logp`` (``behav_logp - logp`` when naive), the k1 estimate of
          KL(old || current) on the sampled tokens;
        - ``ratio_mean``: mean PPO ratio ``r``;
        - ``dual_clip_frac``: fraction of tokens where the dual clip was the active bound (0 when off);
        - ``kl_ref``: mean per-token KL estimate to the reference model (0 when off);
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

    c = correction or Corrections()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    pg, clip_mask, ratio, log_ratio = policy_term(logp, old_logp, advantages, mask, c, eps_clip, seq_index)
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        if c.objective == "cispo":
            raise ValueError("dual_clip_c bounds PPO's clipped term; cispo has none")
        pg3 = -advantages * dual_clip_c  # only binds where A < 0 (for A >= 0 it is >= 0 >= pg)
        dual_mask = (advantages < 0) & (pg3 < pg.detach()) & mask
        pg = torch.where(advantages < 0, torch.minimum(pg, pg3), pg)
    else:
        dual_mask = torch.zeros_like(mask)

    if naive:
        if c.truncates or any(c.has(x) for x in CORRECTION_MASKS):
            raise ValueError(f"corrections {sorted(c.names)} weigh pi_prox / pi_behav, which naive PPO has not")
        keep = mask
        weight = torch.ones_like(pg)
    else:
        weight, keep = behaviour_weight(old_logp - behav_logp, mask, c, behav_imp_weight_cap, seq_index)
    loss_tok = pg * weight
    if token_weights is not None:
        if token_weights.shape != logp.shape:
            raise ValueError(f"token_weights {tuple(token_weights.shape)} do not match logp {tuple(logp.shape)}")
        tw = torch.where(mask, token_weights.detach().to(logp.dtype), zero)
        loss_tok = loss_tok * tw
    else:
        tw = None
    if denominator is None:
        denominator = mask.sum().clamp(min=1)
    total = torch.where(keep, loss_tok, zero).sum()
    kl_tok = None
    if kl_coef and ref_logp is not None:
        if ref_logp.shape != logp.shape:
            raise ValueError(f"ref_logp {tuple(ref_logp.shape)} does not match logp {tuple(logp.shape)}")
        # Masked positions may hold garbage: feed them equal values (KL 0) so exp() stays finite in both passes.
        safe_ref = torch.where(mask, ref_logp.detach().to(logp.dtype), logp.detach())
        kl_tok = torch.where(mask, kl_penalty(logp, safe_ref, kl_estimator), zero)
        total = total + kl_coef * (kl_tok * tw if tw is not None else kl_tok).sum()
    loss = total / denominator

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
            "dual_clip_frac": dual_mask.sum().to(torch.float32) / n_f,
            "kl_ref": (kl_tok.detach().sum().to(torch.float32) / n_f)
            if kl_tok is not None
            else torch.zeros((), dtype=torch.float32, device=logp.device),
            "n_tokens": n.to(torch.float32),
        }
    return loss, stats


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(current || reference) from the sampled tokens' log-probs (Schulman's estimators).

    With ``d = ref_logp - logp``: ``k1 = -d`` (unbiased, can be negative, high variance); ``k3 = exp(d) - d - 1``
    (unbiased for samples from the current policy, always >= 0, lower variance). Gradient flows through ``logp``.
    """
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}")


def turn_segments(loss_mask: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of every maximal run of set loss-mask positions: one run per generated turn (an agent puts
    context tokens, e.g. feedback, between turns)."""
    m = np.asarray(loss_mask).astype(bool).reshape(-1)
    if not m.any():
        return []
    d = np.diff(np.concatenate([[0], m.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


def discounted_turn_returns(turn_rewards: Sequence[float], gamma: float) -> np.ndarray:
    """``G_t = r_t + gamma * G_{t+1}`` (reward-to-go over turns), float64 ``[n_turns]``."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"turn discount must be in [0, 1], got {gamma}")
    r = np.asarray(turn_rewards, dtype=np.float64).reshape(-1)
    out = np.zeros_like(r)
    acc = 0.0
    for t in range(len(r) - 1, -1, -1):
        acc = r[t] + gamma * acc
        out[t] = acc
    return out


def turn_level_advantages(
    returns: Sequence[np.ndarray],
    group_ids: Sequence[str],
    *,
    std_norm: bool = True,
    eps: float = 1e-6,
) -> list[np.ndarray]:
    """Group-normalised per-turn advantages for multi-turn trajectories.

    ``returns[i]`` holds trajectory ``i``'s reward-to-go at each of its turns (`discounted_turn_returns`). The
    baseline of a group is the mean of its trajectories' first-turn returns ``G_0`` (what the prompt is worth);
    turn ``t`` of trajectory ``i`` gets ``(G_t - mean) / (std + eps)``, so a turn that leads to an earlier success
    is credited more than the turns before it. ``std`` is taken over *all* turn returns of the group (not only
    ``G_0``): a group whose first-turn returns are equal can still differ at later turns, and dividing those
    differences by ``eps`` would blow them up. A group whose returns are all equal gets 0. Returns one float32
    array per trajectory.
    """
    if len(returns) != len(group_ids):
        raise ValueError(f"{len(returns)} return arrays for {len(group_ids)} group ids")
    stats: dict[str, tuple[float, float]] = {}
    for g in dict.fromkeys(group_ids):
        members = [np.asarray(returns[i], np.float64) for i, x in enumerate(group_ids) if x == g]
        first = np.array([r[0] if len(r) else 0.0 for r in members])
        pooled = np.concatenate([r for r in members if len(r)] or [np.zeros(1)])
        stats[g] = (float(first.mean()), float(pooled.std()))
    out = []
    for r, g in zip(returns, group_ids):
        mean, std = stats[g]
        a = np.asarray(r, dtype=np.float64) - mean
        if std_norm and std > 0:
            a = a / (std + eps)
        out.append(a.astype(np.float32))
    return out


def sequence_level_weights(loss_mask: Sequence[int] | np.ndarray) -> np.ndarray:
    """Per-token weights ``1 / (loss tokens of the sequence)`` on the loss mask (0 elsewhere): with these as
    ``token_weights`` and ``denominator`` = number of sequences, the loss is the mean over sequences of each
    sequence's token mean (``seq-mean-token-mean``) instead of the mean over all tokens."""
    m = np.asarray(loss_mask).astype(bool).reshape(-1)
    n = int(m.sum())
    return np.where(m, 1.0 / max(n, 1), 0.0).astype(np.float32)


def stale_token_weights(
    versions: np.ndarray, loss_mask: np.ndarray, current_version: int, eta: int, mode: str, decay: float = 0.5
) -> tuple[np.ndarray, np.ndarray]:
    """Staleness at consumption, per token: `StalenessPolicy.token_weights` as a function (tests, ablations).

    Returns ``(loss_mask, weights)``. ``mode``: ``"keep"`` (unchanged, weights 1), ``"drop"`` (stale tokens leave
    the loss mask, so they count in neither the sum nor the token count), ``"downweight"`` (weight
    ``decay ** (lag - eta)`` where ``lag = current_version - version``; they stay in the token count).
    """
    return StalenessPolicy(eta, mode, decay).token_weights(versions, loss_mask, current_version)


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
    return torch.cat([lp.new_zeros(lp.shape[:-1] + (1,)), lp], dim=-1)  # (a one-token row: lp is empty)


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
