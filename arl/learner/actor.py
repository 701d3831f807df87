"""`PPOActor`: decoupled PPO with group advantages on top of any `TrainEngine` (the algorithm, not the mechanics).

One batch, in the order the learner loop calls the phases (every rank runs them on its own share of whole groups):

1. `prepare`: staleness at consumption per token (tokens older than ``version - eta`` kept, dropped or
   down-weighted, as the run's `StalenessPolicy` says) and the loss aggregation become loss masks / per-token
   weights; the batch is split into PPO minibatches of nearly equal tokens (AReaL's ``ppo_n_minibatches``);
2. `compute_logp`: proximal logprobs with the current weights, before any update (and reference logprobs for a
   KL penalty), so every minibatch shares one proximal policy (the first minibatch's come from its own update
   forward where the engine's forwards are one computation: ``prox_from_update``);
3. `compute_advantages`: GRPO advantages from ``traj.reward`` grouped by ``traj.group_id``, broadcast over each
   trajectory's loss tokens (or per-turn advantages where the agent's ``Trajectory.turn_discount`` or
   ``ppo.turn_discount`` asks for them);
4. `ppo_update`: one ``engine.train_batch`` (optimizer step) per minibatch with the decoupled PPO loss of
   `arl.learner.ppo`, then ``version += 1``; returns the step's statistics, reduced over ranks.

With one step per batch ``logp == logp_prox`` where the gradient is taken, so the ratio is exactly 1 and the clip
never binds; from the second minibatch on it moves off 1 and the clip bounds the update (``clip_frac``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch

from arl.api.engine import TrainBatch, TrainEngine
from arl.api.staleness import StalenessPolicy
from arl.api.types import Trajectory
from arl.config import LossAgg, PPOConfig
from arl.learner.batching import MicroBatch, group_members
from arl.learner.corrections import Corrections, mismatch_stats
from arl.learner.ppo import (
    decoupled_ppo_loss,
    discounted_turn_returns,
    entropy_from_logits,
    group_advantages,
    sequence_level_weights,
    shift_right,
    token_logprobs,
    turn_level_advantages,
    turn_segments,
)
from arl.learner.stats import StatsTracker
from arl.utils.timer import PhaseTimer

__all__ = ["PPOActor", "PPOBatch", "METRIC_KEYS", "split_minibatches", "policy_view"]

# What `ppo_update` reports for an engine that computes a loss.
METRIC_KEYS = ("loss", "reward_mean", "reward_std", "adv_abs_mean", "clip_frac", "imp_weight_mean", "capped_frac",
               "approx_kl", "entropy", "grad_norm", "n_seqs", "n_tokens", "head_offpolicyness",
               "tail_offpolicyness", "step_seconds", "tokens_per_s", "lr", "dual_clip_frac", "kl_ref",
               "stale_token_frac", "pad_frac", "turn_reward_mismatch", "mismatch_kl", "mismatch_max_abs",
               "mismatch_frac", "mismatch_tokens")


def split_minibatches(lengths: Sequence[int], k: int, groups: Optional[Sequence[object]] = None) -> list[list[int]]:
    """Indices of `lengths` in `min(k, n)` minibatches of nearly equal token counts (longest first onto the
    lightest; each list in arrival order). Deterministic, so a resumed run splits the same way. With ``groups``
    (one id per sequence) and at least ``k`` of them, whole groups are placed: a group's sequences share prefixes
    the engine computes once per micro-batch (`DeepSpeedEngine.share_prefixes`)."""
    k = max(1, min(int(k), len(lengths)))
    units: list[list[int]] = [[i] for i in range(len(lengths))]
    if groups is not None and len(members := group_members(groups)) >= k:
        units = members
    sizes = [sum(lengths[i] for i in u) for u in units]
    loads = [0] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    for u in sorted(range(len(units)), key=lambda j: (-sizes[j], units[j][0])):
        b = min(range(k), key=lambda m: (loads[m], m))
        parts[b].extend(units[u])
        loads[b] += sizes[u]
    return [sorted(p) for p in parts]


def policy_view(trajs: Sequence[Trajectory], policy: Optional[str]) -> list[Trajectory]:
    """What the learner of `policy` trains on (None: the run's own policy): each trajectory with its loss mask cut
    to the tokens that policy generated (`Trajectory.owned_by`: the others' turns become context) and its reward
    for that policy (`Trajectory.reward_of`); a trajectory with none of its tokens is left out, so it counts in no
    group's advantages either. Trajectories of one policy alone come back as they are."""
    out = []
    for t in trajs:
        if not t.policy_spans and not t.policy_rewards:
            if policy is None:
                out.append(t)
            continue
        mine = t.owned_by(policy)
        if not mine.any():
            continue
        out.append(dataclasses.replace(t, loss_mask=mine.astype(np.int8), logprobs=np.where(mine, t.logprobs, 0.0),
                                       versions=np.where(mine, t.versions, -1), reward=t.reward_of(policy)))
    return out


def _n_scored_seqs(mb: MicroBatch) -> int:
    """Sequences of a micro-batch with at least one loss token (the count sequence-level aggregation divides by)."""
    rows = mb.loss_mask[0].split(mb.seq_lens.tolist()) if mb.packed else mb.loss_mask
    return sum(bool(r.any()) for r in rows)


@dataclasses.dataclass
class PPOBatch:
    """One batch on its way through the phases."""

    received: list[Trajectory]  # as received: advantages read their turns, staleness is reported as received
    data: TrainBatch  # loss masks after per-token staleness; fields filled phase by phase
    minibatches: list[list[int]]
    version: int  # the policy version this batch updates
    stats: StatsTracker
    timer: PhaseTimer  # 'step': from `prepare` to the end of `ppo_update` (step_seconds)
    prox_from_update: bool = False  # the first minibatch's proximal logprobs come from its update forward


class PPOActor:
    """Decoupled PPO (`ppo.decoupled_ppo_loss`) through ``engine``.

    Args:
        engine: any `TrainEngine` (DeepSpeed, simulated, a rank leader's view).
        ppo: the algorithm's settings (`arl.config.PPOConfig`).
        temperature: sampling temperature of the behaviour policy; logprobs are taken under logits / temperature.
        staleness: the run's `StalenessPolicy` (eta and ``stale_tokens``; the one the learner worker drops groups
            by): tokens older than ``version - eta`` are counted in ``stale_token_frac`` and kept, dropped or
            down-weighted. The default has no bound.
        policy: the policy this actor trains, when a run has several (`docs/multi_policy.md`): only its own tokens,
            with its own rewards (`policy_view`); its versions are its engine's. None: the run's own policy.
    """

    def __init__(self, engine: TrainEngine, ppo: PPOConfig, temperature: float = 1.0,
                 staleness: StalenessPolicy = StalenessPolicy(), policy: Optional[str] = None) -> None:
        self.engine = engine
        self.policy = policy
        self.ppo = ppo
        self.temperature = float(temperature)
        self.staleness = staleness
        # whole groups per minibatch where the engine computes a group's shared prefixes once per micro-batch
        self.group_minibatches = bool(getattr(engine, "share_prefixes", False))
        self.corrections = Corrections.from_config(ppo)

    @property
    def version(self) -> int:
        return self.engine.version

    def step(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        """The four phases in one call (tests, benchmarks); the learner loop calls them one by one."""
        batch = self.prepare(trajs)
        self.compute_logp(batch)
        self.compute_advantages(batch)
        return self.ppo_update(batch)

    # ------------------------------------------------------------------ phases
    def prepare(self, trajs: Sequence[Trajectory]) -> PPOBatch:
        """Per-token staleness and loss weights, the minibatch split and the batch's own statistics (of this
        actor's policy's view of the batch)."""
        if len(trajs) == 0:
            raise ValueError("a training step needs a non-empty batch")
        trajs = policy_view(trajs, self.policy)
        if not trajs:
            raise ValueError(f"a training step needs tokens of its policy, and this batch has none of policy "
                             f"{self.policy!r} (None: the run's own)")
        timer, v, ppo = PhaseTimer(time.perf_counter), self.engine.version, self.ppo
        timer.start("step")
        stats = StatsTracker()
        rewards = np.array([t.reward for t in trajs], np.float32).astype(np.float64)
        stats.add("n_seqs", len(trajs))
        stats.add("reward_mean", float(rewards.sum()), "mean", weight=len(trajs))
        stats.add("reward_sq", float((rewards**2).sum()), "mean", weight=len(trajs))
        gen = np.concatenate([t.versions[t.loss_mask.astype(bool)] for t in trajs])
        stats.add("version_min", float(gen.min()) if gen.size else math.inf, "min")  # as received, before drops
        stats.add("version_max", float(gen.max()) if gen.size else -math.inf, "max")
        out, weights, n_stale, scored = [], [], 0, 0
        for t in trajs:
            m = t.loss_mask.astype(bool).copy()
            if len(m):
                m[0] = False  # never scored (no prefix), see batching
            scored += int(m.sum())
            n_stale += int(self.staleness.stale(t.versions, m, v).sum())
            m2, w = self.staleness.token_weights(t.versions, m, v)
            if not np.array_equal(m2, m):
                m = m2
                t = dataclasses.replace(t, loss_mask=m.astype(np.int8))
            if ppo.loss_agg == LossAgg.seq:
                w = w * sequence_level_weights(m)
            out.append(t)
            weights.append(w)
        stats.add("stale_token_frac", n_stale, "mean", weight=scored)
        stats.add("n_tokens", sum(int(t.loss_mask[1:].sum()) for t in out))  # loss tokens after the drops
        data = TrainBatch(out)
        if ppo.loss_agg == LossAgg.seq or self.staleness.stale_tokens == "downweight":
            data.fields["token_weights"] = weights
        n_mini = ppo.minibatches
        if n_mini > 1:  # every rank splits into the same number, and no minibatch is empty on any rank
            n_mini = min(n_mini, int(-self.engine.all_reduce([-float(len(out))], op="max")[0]))
        groups = [t.group_id for t in out] if self.group_minibatches else None
        parts = split_minibatches([len(t.input_ids) for t in out], n_mini, groups)
        own = bool(getattr(self.engine, "prox_from_update", False)) and not ppo.naive_ppo
        return PPOBatch(list(trajs), data, parts, v, stats, timer, prox_from_update=own)

    def compute_logp(self, batch: PPOBatch) -> None:
        """Proximal logprobs (and reference logprobs with a KL penalty) under the weights before this update.

        Naive PPO reads no proximal logprobs, so none are computed. The first minibatch's are not computed either
        where the engine's update forward is the same computation as its `forward_logprobs` (``prox_from_update``:
        same weights, same mode, no dropout): the loss takes them from that forward, detached (`_loss`), which
        saves one of the step's forward passes."""
        names = (["prox_logp"] if not self.ppo.naive_ppo else []) + (["ref_logp"] if self.ppo.kl_coef else [])
        out: dict[str, list[Any]] = {name: [None] * len(batch.data) for name in names}
        trajs = batch.data.trajs
        for name in names:
            parts = list(batch.minibatches)
            if name == "prox_logp" and batch.prox_from_update:
                for i in parts.pop(0):  # a placeholder the loss replaces with its own logprobs
                    out[name][i] = np.zeros(len(trajs[i].input_ids), np.float32)
            # one call over the minibatches (whole groups each): the engine packs them into as few forwards as
            # its token budget allows, rather than one forward (and its fixed cost) per minibatch
            idx = [i for part in parts for i in part]
            if idx:
                lps = self.engine.forward_logprobs(TrainBatch([trajs[i] for i in idx]), self.temperature,
                                                   reference=name == "ref_logp", scored_only=True)
                for i, lp in zip(idx, lps):
                    out[name][i] = lp
        batch.data.fields.update(out)

    def compute_advantages(self, batch: PPOBatch) -> None:
        adv, mismatched = self.advantages(batch.received)
        batch.data.fields["advantages"] = adv
        batch.stats.add("turn_reward_mismatch", mismatched)  # every step: all ranks reduce the same names

    def advantages(self, trajs: Sequence[Trajectory]) -> tuple[list[Any], int]:
        """Per-trajectory advantages and the number of trajectories whose turn rewards did not match their turns
        (they fall back to ``reward`` for every turn).

        A group is credited per turn (one float32 array per trajectory) when ``ppo.turn_discount`` is set, or else
        when its agent set ``Trajectory.turn_discount``; otherwise by one scalar per trajectory (GRPO)."""
        gids = [t.group_id for t in trajs]
        gammas = [self.ppo.turn_discount if self.ppo.turn_discount is not None else t.turn_discount for t in trajs]
        per_turn_groups = {g for g, gamma in zip(gids, gammas) if gamma is not None}
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        out: list[Any] = group_advantages(rewards, gids, std_norm=self.ppo.adv_std_norm).tolist()
        turn_idx = [i for i, g in enumerate(gids) if g in per_turn_groups]
        if not turn_idx:
            return out, 0
        returns, segs, mismatched = [], [], 0
        for i in turn_idx:
            t, gamma = trajs[i], gammas[i]
            sg = turn_segments(t.loss_mask)
            segs.append(sg)
            if gamma is not None and sg and len(t.turn_rewards) == len(sg):
                returns.append(discounted_turn_returns(t.turn_rewards, gamma))
            else:
                mismatched += int(bool(sg))
                returns.append(np.full(max(len(sg), 1), t.reward, np.float64))
        per_turn = turn_level_advantages(returns, [gids[i] for i in turn_idx], std_norm=self.ppo.adv_std_norm)
        for i, sg, a in zip(turn_idx, segs, per_turn):
            tok = np.zeros(len(trajs[i].input_ids), np.float32)
            for (s, e), val in zip(sg, a):
                tok[s:e] = val
            out[i] = tok
        return out, mismatched

    def ppo_update(self, batch: PPOBatch) -> dict[str, float]:
        """One optimizer step per minibatch, then ``version += 1``; the step's statistics over every rank."""
        weight_fn = _n_scored_seqs if self.ppo.loss_agg == LossAgg.seq else (lambda mb: mb.n_loss_tokens)
        for i, part in enumerate(batch.minibatches):
            loss_fn = functools.partial(self._loss, stats=batch.stats, own_prox=i == 0 and batch.prox_from_update,
                                        first=i == 0, version=batch.version)
            out = dict(self.engine.train_batch(batch.data.select(part), loss_fn, weight_fn))
            lr = out.pop("lr", None)
            if lr is not None and i == 0:  # the rate the batch started with
                batch.stats.add("lr", lr, "max")
            if "grad_norm" in out:
                batch.stats.add("grad_norm", out.pop("grad_norm"), "mean")
            if "padded_tokens" in out:
                padded = out.pop("padded_tokens")
                batch.stats.add("pad_frac", padded - out.pop("real_tokens"), "mean", weight=padded)
            for k, val in out.items():  # anything else the engine reports, summed
                batch.stats.add(k, val)
        self.engine.version = batch.version + 1
        return self._summary(batch, len(batch.minibatches), batch.timer.pop()["step"])

    # ------------------------------------------------------------------ loss and statistics
    def _loss(self, logits: torch.Tensor, mb: MicroBatch, denominator: float, stats: StatsTracker,
              own_prox: bool = False, first: bool = False, version: int = 0) -> torch.Tensor:
        """The decoupled PPO loss of a micro-batch; ``own_prox``: its proximal logprobs are its own, detached (the
        first minibatch, before any update of this step: see `compute_logp`). ``first``: the step's first
        minibatch, whose forward runs the weights of `version` (what the mismatch monitor compares with)."""
        ppo = self.ppo
        logp = token_logprobs(logits, mb.input_ids, self.temperature)
        loss, st = decoupled_ppo_loss(
            logp, logp.detach() if own_prox else mb.prox_logp, mb.logprobs, mb.advantages, mb.loss_mask,
            eps_clip=ppo.eps_clip, behav_imp_weight_cap=ppo.behav_imp_weight_cap, naive=ppo.naive_ppo,
            denominator=denominator, dual_clip_c=ppo.dual_clip_c, token_weights=mb.token_weights,
            ref_logp=mb.ref_logp, kl_coef=ppo.kl_coef, kl_estimator=ppo.kl_estimator,
            correction=self.corrections, seq_index=mb.seq_index if self.corrections.per_sequence else None,
        )
        with torch.no_grad():  # every micro-batch adds every name (zeros for an empty one): ranks line up
            # the learner's logprobs under the weights the engine sampled with: the step's first forward, or the
            # proximal ones (computed before any update); naive PPO has only the first
            train = logp if first else mb.prox_logp
            mm = mismatch_stats(train, mb.logprobs, mb.versions, mb.loss_mask, version, ppo.mismatch_log_ratio)
            tok = mm["mismatch_tokens"]
            stats.add("mismatch_kl", mm["mismatch_kl_sum"], "mean", weight=tok)
            stats.add("mismatch_frac", mm["mismatch_over"], "mean", weight=tok)
            stats.add("mismatch_max_abs", mm["mismatch_max_abs"], "max")
            stats.add("mismatch_tokens", tok)
            n = float(st["n_tokens"])
            ent = float(shift_right(entropy_from_logits(logits.detach(), self.temperature))[mb.loss_mask].sum()) \
                if n > 0 else 0.0
            stats.add("entropy", ent, "mean", weight=n)
            for k in ("clip_frac", "capped_frac", "approx_kl", "dual_clip_frac", "kl_ref"):
                stats.add(k, float(st[k]) * n if n > 0 else 0.0, "mean", weight=n)
            kept = n * (1.0 - float(st["capped_frac"])) if n > 0 else 0.0
            stats.add("imp_weight_mean", float(st["imp_weight_mean"]) * kept, "mean", weight=kept, default=1.0)
            stats.add("adv_abs_mean", float(mb.advantages[mb.loss_mask].abs().sum()), "mean", weight=n)
            stats.add("loss", float(loss.detach()))  # summed over ranks: / world size / minibatches below
        return loss

    def _summary(self, batch: PPOBatch, n_mini: int, elapsed: float) -> dict[str, float]:
        out = batch.stats.reduce(self.engine.all_reduce)
        v = batch.version
        vmin, vmax = out.pop("version_min"), out.pop("version_max")
        out["head_offpolicyness"] = float(v - vmin) if math.isfinite(vmin) else 0.0
        out["tail_offpolicyness"] = float(v - vmax) if math.isfinite(vmax) else 0.0
        out["reward_std"] = math.sqrt(max(out.pop("reward_sq") - out["reward_mean"] ** 2, 0.0))
        if "loss" in out:
            out["loss"] = out["loss"] / self.engine.world_size / n_mini  # mean over the minibatches' losses
        out["step_seconds"] = elapsed
        out["tokens_per_s"] = out.get("n_tokens", 0.0) / elapsed if elapsed > 0 else 0.0
        return out
