"""Off-policy corrections of the objective, and the train-inference mismatch monitor: pure tensor functions.

Three policies meet in an asynchronous step: the behaviour policy that sampled a token (the inference engine, at
the token's version), the proximal policy (the learner's weights before this step) and the current one (with the
gradient). ``decoupled_ppo_loss`` (`arl.learner.ppo`) weighs each token by the behaviour weight
``w = pi_prox / pi_behav`` and takes a policy term on ``r = pi / pi_prox``. A `Corrections` changes either:

- the **behaviour weight** (at most one): ``tis`` truncates ``w`` per token at ``tis_cap`` (Yao et al. 2025, "Your
  Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's token TIS); ``seq_tis`` weighs every
  token of a sequence by its truncated sequence weight ``min(prod_t w_t, seq_threshold)`` (verl's sequence TIS).
  Both replace AReaL's filter (``behav_imp_weight_cap``: tokens with ``w > cap`` leave the numerator);
- **masks** (any of them; a masked token leaves the numerator and stays in the denominator, as the cap filter):
  ``mis`` tokens with ``w`` outside ``[1/t, t]`` (verl's token rejection); ``seq_mis`` sequences with ``prod_t w_t``
  outside ``[1/t, t]`` (verl's sequence rejection); ``geo_mask`` sequences whose geometric mean
  ``exp(mean_t log w_t)`` leaves ``[1/g, g]`` (verl's geometric rejection); ``icepop`` tokens with ``w`` outside
  ``[a, b]`` (IcePop, Ling team 2025: the Ring-1T report; AReaL's IcePop);
- the **policy term** (at most one; none: PPO's clip): ``cispo`` is ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A *
  log pi`` on every token, no token's gradient ever clipped away (MiniMax-M1, 2025); ``gspo`` replaces the token
  ratio by the sequence ratio ``s = exp(mean_t log r_t)``, clipped by a tight ``gspo_eps`` (Zheng et al. 2025,
  "Group Sequence Policy Optimization").

Sequence-level quantities are taken over each sequence's loss tokens; ``seq_index`` (per token, the sequence it
belongs to within its micro-batch: `MicroBatch.seq_index`) says which tokens share one. Every function here is
checked against its formula on hand-built logprobs in tests/learner/test_corrections.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import Tensor

from arl.config import Correction, PPOConfig

__all__ = ["Corrections", "per_sequence", "behaviour_weight", "policy_term", "mismatch_stats"]

_LOG_SAFE = 20.0  # sequence log-weights are bounded here before exp (verl's safety bound): no inf, no nan


@dataclasses.dataclass(frozen=True)
class Corrections:
    """Which corrections are on and their thresholds (plain values; `from_config` reads `learner.ppo`)."""

    names: frozenset[str] = frozenset()
    tis_cap: float = 2.0
    mis_threshold: float = 2.0
    seq_threshold: float = 2.0
    geo_threshold: float = 1.01
    icepop_band: tuple[float, float] = (0.5, 5.0)
    cispo_eps: tuple[float, float] = (1.0, 4.0)
    gspo_eps: tuple[float, float] = (3e-4, 4e-4)

    @classmethod
    def from_config(cls, ppo: PPOConfig) -> "Corrections":
        return cls(frozenset(ppo.correction), float(ppo.tis_cap), float(ppo.mis_threshold),
                   float(ppo.seq_threshold), float(ppo.geo_threshold), tuple(map(float, ppo.icepop_band)),
                   tuple(map(float, ppo.cispo_eps)), tuple(map(float, ppo.gspo_eps)))

    def has(self, c: Correction) -> bool:
        return c.value in self.names

    @property
    def objective(self) -> str:
        """'cispo', 'gspo' or 'ppo' (the clip)."""
        return next((c.value for c in (Correction.cispo, Correction.gspo) if self.has(c)), "ppo")

    @property
    def truncates(self) -> bool:
        """The behaviour weight is truncated (tis, seq_tis), not filtered by the cap."""
        return self.has(Correction.tis) or self.has(Correction.seq_tis)

    @property
    def per_sequence(self) -> bool:
        """Some correction needs to know which tokens share a sequence."""
        return any(self.has(c) for c in (Correction.seq_tis, Correction.seq_mis, Correction.geo_mask,
                                         Correction.gspo))


def per_sequence(x: Tensor, seq_index: Tensor, mask: Tensor, mean: bool = False) -> Tensor:
    """Per token: the sum (or mean) of ``x`` over the masked tokens of its sequence. Differentiable through ``x``.
    A sequence without masked tokens gets 0."""
    ids = seq_index[mask]
    n = int(seq_index.max().item()) + 1 if seq_index.numel() else 1
    sums = x.new_zeros(n).index_add(0, ids, x[mask])
    if mean:
        counts = x.new_zeros(n).index_add(0, ids, torch.ones_like(x[mask]))
        sums = sums / counts.clamp(min=1)
    return sums[seq_index]


def behaviour_weight(log_w: Tensor, mask: Tensor, c: Corrections, cap: Optional[float],
                     seq_index: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """``(weight, keep)``: each token's behaviour weight after the corrections of ``c`` (0 where not kept) and the
    tokens it keeps in the numerator. ``log_w`` is ``log pi_prox - log pi_behav`` (0 off ``mask``, no gradient);
    ``cap`` is AReaL's filter (None: off), applied unless a truncation replaces it."""
    mask = mask.bool()
    zero = torch.zeros((), dtype=log_w.dtype, device=log_w.device)
    log_w = torch.where(mask, log_w, zero)
    w = log_w.exp()
    keep = mask
    if c.per_sequence and seq_index is None:
        raise ValueError(f"corrections {sorted(c.names)} need seq_index (which tokens share a sequence)")
    if c.has(Correction.tis):
        weight = w.clamp(max=c.tis_cap)
    elif c.has(Correction.seq_tis):
        log_seq = per_sequence(log_w, seq_index, mask).clamp(-_LOG_SAFE, _LOG_SAFE)
        weight = log_seq.exp().clamp(max=c.seq_threshold)
    else:
        weight = w
        if cap is not None:
            keep = keep & (w <= cap)
    if c.has(Correction.mis):
        keep = keep & (log_w.abs() <= math.log(c.mis_threshold))
    if c.has(Correction.seq_mis):
        keep = keep & (per_sequence(log_w, seq_index, mask).abs() <= math.log(c.seq_threshold))
    if c.has(Correction.geo_mask):
        keep = keep & (per_sequence(log_w, seq_index, mask, mean=True).abs() <= math.log(c.geo_threshold))
    if c.has(Correction.icepop):
        low, high = c.icepop_band
        keep = keep & (w >= low) & (w <= high)
    return torch.where(keep, weight, zero), keep


def policy_term(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, c: Corrections,
                eps_clip: float, seq_index: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(pg, clip_mask, ratio, log_ratio)`` per token: the loss term before the behaviour weight, where the clip
    was active, the ratio it used and ``log pi - log pi_old`` (0 off ``mask``). ``pg``'s gradient flows through
    ``logp`` only. PPO: ``max(-A r, -A clip(r, 1 - eps, 1 + eps))``; GSPO: the same on the sequence ratio;
    CISPO: ``-A * sg(clip(r, 1 - eps_low, 1 + eps_high)) * logp``."""
    mask = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(mask, logp - old_logp, zero)  # masked positions may hold garbage: exp stays finite
    if c.objective == "cispo":
        ratio = log_ratio.detach().exp()
        low, high = c.cispo_eps
        clipped = ratio.clamp(1.0 - low, 1.0 + high)
        pg = -advantages * clipped * torch.where(mask, logp, zero)
        return pg, (clipped != ratio) & mask, ratio, log_ratio
    if c.objective == "gspo":
        if seq_index is None:
            raise ValueError("gspo needs seq_index (which tokens share a sequence)")
        log_s = per_sequence(log_ratio, seq_index, mask, mean=True).clamp(-_LOG_SAFE, _LOG_SAFE)
        ratio = torch.where(mask, log_s.exp(), zero + 1.0)
        low, high = c.gspo_eps
        clipped = ratio.clamp(1.0 - low, 1.0 + high)
    else:
        ratio = log_ratio.exp()
        clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip)
    pg1, pg2 = -advantages * ratio, -advantages * clipped
    return torch.maximum(pg1, pg2), (pg2.detach() > pg1.detach()) & mask, ratio, log_ratio


def mismatch_stats(train_logp: Optional[Tensor], behav_logp: Tensor, versions: Tensor, mask: Tensor, version: int,
                   threshold: float) -> dict[str, float]:
    """The train-inference mismatch on the tokens the engine sampled with the learner's current weights (version
    == ``version``): the same policy on both sides, so any difference is numerics (precision, kernels, batching).

    Sums, so micro-batches and ranks add up: ``mismatch_kl_sum`` (the k3 estimate of KL(engine || learner) from the
    engine's samples, ``exp(d) - 1 - d`` with ``d = log pi_learner - log pi_engine``), ``mismatch_over`` (tokens
    with ``|d| > threshold``), ``mismatch_tokens``; and ``mismatch_max_abs`` (the largest ``|d|``). Zeros where
    there is no such token or no ``train_logp`` (naive PPO's later minibatches have no proximal logprobs)."""
    sel = mask.bool() & (versions == int(version))
    d = (train_logp.detach().float() - behav_logp.detach().float())[sel] if train_logp is not None else sel[:0]
    if d.numel() == 0:
        return {"mismatch_kl_sum": 0.0, "mismatch_over": 0.0, "mismatch_tokens": 0.0, "mismatch_max_abs": 0.0}
    return {"mismatch_kl_sum": float((torch.expm1(d) - d).sum()), "mismatch_over": float((d.abs() > threshold).sum()),
            "mismatch_tokens": float(d.numel()), "mismatch_max_abs": float(d.abs().max())}
