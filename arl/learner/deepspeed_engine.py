"""`DeepSpeedLearner`: the learner engine (decoupled PPO with group advantages) on top of `deepspeed.initialize`.

One `train_step(batch)` is one optimizer step, whatever the number of micro-batches:

1. proximal logprobs are recomputed with the current weights (no grad, eval mode);
2. GRPO advantages from ``traj.reward`` grouped by ``traj.group_id``, broadcast over each trajectory's loss-mask
   tokens (or per-turn advantages with ``turn_discount``); staleness at consumption and the loss aggregation
   become per-token loss masks / weights;
3. the batch is split into micro-batches by a token budget (`arl.learner.batching`): packed without padding by
   default (``packing=True``, see `arl.learner.packing`), right-padded otherwise; each micro-batch's loss is
   ``sum of its token losses / tokens in the whole batch`` (times the data-parallel world size, because DeepSpeed
   averages gradients over ranks), so the accumulated gradient is the gradient of the token-level mean over the
   whole (global) batch, independent of how it was split;
4. one ``engine.step()``;
5. ``version += 1``.

Gradient-accumulation boundary. DeepSpeed is configured with ``train_micro_batch_size_per_gpu=1`` and
``gradient_accumulation_steps=1`` and keeps its default *managed* accumulation mode, so ``engine.backward`` does
not rescale the loss (it divides by GAS = 1). The number of micro-batches varies per step, so the boundary is set by
hand before every backward with ``engine.set_gradient_accumulation_boundary(is_last)``: ``False`` for all but the
last micro-batch (gradients accumulate locally; stage 0/1 defer the all-reduce, stage 2/3 reduce into their
partitioned buffers), ``True`` for the last (stage 0/1 all-reduce, ZeRO finalises). ``engine.step()`` is then
called once; DeepSpeed sees the boundary flag and runs clipping + the optimizer. With several ranks, ZeRO-2/3 issue
collectives in every backward, so ranks must run the same number of micro-batches: the learner all-reduces the
maximum count and pads with empty micro-batches (zero loss, still a backward). (DeepSpeed 0.19.8 also has
``managed_gradient_accumulation=False`` where every ``step()`` is the boundary; it refuses ``overlap_comm`` with
stages 1/3, so the documented ``set_gradient_accumulation_boundary`` path is used instead.)

Distributed setup: without RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK in the environment the learner sets
single-process defaults (a free local port) before ``deepspeed.init_distributed`` -- DeepSpeed otherwise tries MPI
discovery. The backend is gloo on CPU and DeepSpeed's default (nccl) on GPU. Each rank passes its own share of the
batch to `train_step` (whole groups per rank, since advantages are normalised within a group).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
import math
import os
import random
import shutil
import socket
import tempfile
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch

from arl.api.types import Trajectory
from arl.learner.checkpoint import CHECKPOINT_STATE_FILE, latest_checkpoint, read_checkpoint_state
from arl.learner.batching import MicroBatch, build_micro_batches, build_packed_micro_batches
from arl.learner.packing import enable_varlen_attention, packed_forward_kwargs
from arl.learner.ppo import (
    decoupled_ppo_loss,
    discounted_turn_returns,
    entropy_from_logits,
    group_advantages,
    sequence_level_weights,
    shift_right,
    stale_token_weights,
    token_logprobs,
    turn_level_advantages,
    turn_segments,
)

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedLearner", "ensure_distributed", "METRIC_KEYS", "lr_lambda", "latest_checkpoint",
           "read_checkpoint_state", "CHECKPOINT_STATE_FILE", "learner_from_config"]

METRIC_KEYS = (
    "loss",
    "reward_mean",
    "reward_std",
    "adv_abs_mean",
    "clip_frac",
    "imp_weight_mean",
    "capped_frac",
    "approx_kl",
    "entropy",
    "grad_norm",
    "n_seqs",
    "n_tokens",
    "head_offpolicyness",
    "tail_offpolicyness",
    "step_seconds",
    "tokens_per_s",
    "lr",
    "dual_clip_frac",
    "kl_ref",
    "stale_token_frac",
    "pad_frac",
)

_DIST_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_distributed() -> None:
    """Initialise torch.distributed through DeepSpeed if nobody has; single-process defaults when no launcher set
    the environment (RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR=127.0.0.1, a free MASTER_PORT)."""
    import deepspeed
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return
    # DeepSpeed JIT-builds its CPU comm op into TORCH_EXTENSIONS_DIR. Builds for different torch versions (another
    # virtualenv on the same machine) share the default folder and replace each other's .so, so a process can
    # find it half-rebuilt and fail to import it: keep one folder per torch version.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.expanduser("~/.cache/torch_extensions"),
                                                               f"torch-{torch.__version__}"))
    if not all(k in os.environ for k in _DIST_ENV):
        defaults = {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
        }
        if any(k in os.environ for k in _DIST_ENV) and os.environ.get("WORLD_SIZE", "1") != "1":
            missing = [k for k in _DIST_ENV if k not in os.environ]
            raise RuntimeError(f"partial distributed environment (WORLD_SIZE>1 but {missing} unset)")
        added = [k for k in defaults if k not in os.environ]
        for k in added:
            os.environ[k] = defaults[k]
    else:
        added = []
    backend = None if torch.cuda.is_available() else "gloo"
    try:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    finally:
        # The rendezvous address we made up is this process's business: a child process (a test, a benchmark
        # or the launcher starting its own learner) must not inherit MASTER_PORT and try to bind it again.
        # RANK / WORLD_SIZE / LOCAL_RANK stay: DeepSpeed reads LOCAL_RANK whenever an engine is created.
        for k in ("MASTER_ADDR", "MASTER_PORT"):
            if k in added:
                os.environ.pop(k, None)


def _n_scored_seqs(mb: MicroBatch) -> int:
    """Sequences of a micro-batch with at least one loss token (the count sequence-level aggregation divides by)."""
    if not mb.packed:
        return int((mb.loss_mask.sum(-1) > 0).sum())
    bounds = mb.cu_seqlens.tolist()
    return int(sum(bool(mb.loss_mask[0, s:e].any()) for s, e in zip(bounds[:-1], bounds[1:])))


def split_minibatches(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Indices of `lengths` in `min(k, n)` minibatches of nearly equal token counts (longest first onto the
    lightest; each list in arrival order). Deterministic, so a resumed run splits the same way."""
    k = max(1, min(int(k), len(lengths)))
    if k == 1:
        return [list(range(len(lengths)))]
    loads = [0] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        b = min(range(k), key=lambda m: (loads[m], m))
        parts[b].append(i)
        loads[b] += lengths[i]
    return [sorted(p) for p in parts]


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0):
    """LR multiplier per optimizer step ``k`` (0-based): linear warm-up over ``warmup_steps`` (from ``1/warmup``
    to 1), then ``constant``, ``linear`` decay or ``cosine`` decay down to ``min_lr_ratio`` at ``total_steps``."""
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr_schedule must be 'constant', 'linear' or 'cosine', got {schedule!r}")
    if warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"bad LR schedule: warmup_steps={warmup_steps}, min_lr_ratio={min_lr_ratio}")

    def fn(k: int) -> float:
        if k < warmup_steps:
            return (k + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        frac = min(1.0, (k - warmup_steps) / span)
        if schedule == "linear":
            return 1.0 - (1.0 - min_lr_ratio) * frac
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))

    return fn


class DeepSpeedLearner:
    """Decoupled-PPO learner on a HF causal LM, trained through DeepSpeed (implements `LearnerEngine`).

    Args:
        model: a HF causal LM (``model(input_ids=..., attention_mask=...).logits``); DeepSpeed takes it over.
        lr, betas, weight_decay: client ``torch.optim.AdamW`` (no compiled DeepSpeed op needed).
        grad_clip: DeepSpeed ``gradient_clipping`` (0 disables).
        zero_stage: 0..3. offload_optimizer: ZeRO-Offload of the optimizer state to CPU (stage >= 1).
        bf16: DeepSpeed bf16 mode (weights/activations in bf16, fp32 master weights in the optimizer).
        max_tokens_per_mb: padded-token budget of one micro-batch.
        eps_clip, behav_imp_weight_cap, naive_ppo: see `arl.learner.ppo.decoupled_ppo_loss`.
        adv_std_norm: divide group-centred rewards by the group std.
        temperature: sampling temperature of the behaviour policy; logprobs are taken under logits / temperature.
        version: policy version of the initial weights. seed: seeds python/numpy/torch RNGs of this process.
        packing: padding-free micro-batches (`build_packed_micro_batches`, budget = real tokens) instead of right-
            padded ones (budget = padded tokens). packed_attention: ``"varlen"`` (per-sequence SDPA, see
            `arl.learner.packing`) or ``"mask"`` (transformers' block-diagonal mask from restarting position ids).
        dual_clip_c: dual-clip bound for negative advantages (None: off).
        loss_agg: ``"token"`` (mean over all loss tokens of the global batch) or ``"seq"`` (mean over sequences of
            each sequence's token mean).
        kl_coef, kl_estimator: KL(current || reference) penalty, ``k1`` or ``k3``; the reference is a frozen copy
            of ``model`` as given (the initial weights) unless ``ref_model`` is passed. 0 disables (no copy made).
        turn_discount: None: one advantage per trajectory from ``traj.reward``. A float gamma: per-turn
            advantages from ``traj.turn_rewards`` (reward-to-go with discount gamma over turns, group baseline from
            the first-turn returns, `ppo.turn_level_advantages`); a turn = a maximal run of loss-mask tokens.
        max_head_offpolicyness, stale_tokens, stale_token_decay: staleness at consumption per token. Tokens older
            than ``version - eta`` are kept (``"keep"``), dropped (``"drop"``) or down-weighted by
            ``decay ** (lag - eta)`` (``"downweight"``). ``stale_token_frac`` is reported whenever eta is given.
        lr_schedule, warmup_steps, total_steps, min_lr_ratio: LR multiplier per optimizer step (`lr_lambda`),
            handed to DeepSpeed as its LR scheduler (saved and restored with checkpoints).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        zero_stage: int = 0,
        offload_optimizer: bool = False,
        bf16: bool = False,
        max_tokens_per_mb: int = 4096,
        eps_clip: float = 0.2,
        behav_imp_weight_cap: Optional[float] = 5.0,
        naive_ppo: bool = False,
        ppo_minibatches: int = 1,
        adv_std_norm: bool = True,
        temperature: float = 1.0,
        version: int = 0,
        seed: int = 0,
        packing: bool = True,
        packed_attention: str = "varlen",
        dual_clip_c: Optional[float] = None,
        loss_agg: str = "token",
        kl_coef: float = 0.0,
        kl_estimator: str = "k1",
        ref_model: Optional[torch.nn.Module] = None,
        turn_discount: Optional[float] = None,
        max_head_offpolicyness: Optional[int] = None,
        stale_tokens: str = "keep",
        stale_token_decay: float = 0.5,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        total_steps: int = 1,
        min_lr_ratio: float = 0.0,
    ) -> None:
        import deepspeed

        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0..3, got {zero_stage}")
        if offload_optimizer and zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage >= 1")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if behav_imp_weight_cap is not None and behav_imp_weight_cap <= 1.0:
            raise ValueError(f"behav_imp_weight_cap must be > 1 (or None), got {behav_imp_weight_cap}")
        self.max_tokens_per_mb = int(max_tokens_per_mb)
        self.eps_clip = float(eps_clip)
        self.behav_imp_weight_cap = behav_imp_weight_cap
        self.naive_ppo = bool(naive_ppo)
        self.adv_std_norm = bool(adv_std_norm)
        self.temperature = float(temperature)
        self._version = int(version)
        self.seed = int(seed)
        self.zero_stage = int(zero_stage)
        self.bf16 = bool(bf16)
        if packed_attention not in ("varlen", "mask"):
            raise ValueError(f"packed_attention must be 'varlen' or 'mask', got {packed_attention!r}")
        if loss_agg not in ("token", "seq"):
            raise ValueError(f"loss_agg must be 'token' or 'seq', got {loss_agg!r}")
        if kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {kl_estimator!r}")
        if dual_clip_c is not None and dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (or None), got {dual_clip_c}")
        if turn_discount is not None and not 0.0 <= turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in [0, 1] (or None), got {turn_discount}")
        if stale_tokens not in ("keep", "drop", "downweight"):
            raise ValueError(f"stale_tokens must be 'keep', 'drop' or 'downweight', got {stale_tokens!r}")
        if stale_tokens != "keep" and max_head_offpolicyness is None:
            raise ValueError("stale_tokens='drop'/'downweight' needs max_head_offpolicyness (eta)")
        if not isinstance(ppo_minibatches, int) or ppo_minibatches < 1:
            raise ValueError(f"ppo_minibatches must be an int >= 1, got {ppo_minibatches!r}")
        self.ppo_minibatches = ppo_minibatches
        lr_fn = lr_lambda(lr_schedule, int(warmup_steps), int(total_steps), float(min_lr_ratio))
        self.packing = bool(packing)
        self.packed_attention = packed_attention
        self.dual_clip_c = dual_clip_c
        self.loss_agg = loss_agg
        self.kl_coef = float(kl_coef)
        self.kl_estimator = kl_estimator
        self.turn_discount = turn_discount
        self.eta = max_head_offpolicyness
        self.stale_tokens = stale_tokens
        self.stale_token_decay = float(stale_token_decay)
        self.ref_model: Optional[torch.nn.Module] = None
        if self.kl_coef:
            ref = ref_model if ref_model is not None else copy.deepcopy(model)
            ref.eval()
            for p_ in ref.parameters():
                p_.requires_grad_(False)
            self.ref_model = ref
        if self.packing and self.packed_attention == "varlen":
            enable_varlen_attention(model)
            if self.ref_model is not None:
                enable_varlen_attention(self.ref_model)

        if self.bf16 and self.zero_stage == 0:
            # DeepSpeed 0.19.8 wraps bf16 + stage 0 + a client optimizer in FP16_UnfusedOptimizer, which
            # accumulates gradients in bf16; stage >= 1 uses fp32 gradient accumulation.
            logger.warning("bf16 with zero_stage=0 accumulates gradients in bf16; prefer zero_stage>=1 with bf16")
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

        ensure_distributed()
        import deepspeed.comm as dist

        self._dist = dist
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()

        zero: dict[str, Any] = {"stage": self.zero_stage}
        if offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if self.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        self.ds_config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": float(grad_clip),
            "zero_optimization": zero,
            "bf16": {"enabled": self.bf16},
            # A client torch AdamW with ZeRO-Offload: allowed (DeepSpeedCPUAdam would JIT-compile an op).
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        self.pad_token_id = int(getattr(getattr(model, "config", None), "pad_token_id", None) or 0)
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=lr, betas=tuple(betas), weight_decay=weight_decay
        )
        self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config=self.ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_fn),
        )
        self.device = self.engine.device
        if self.ref_model is not None:
            self.ref_model.to(self.device)

    # ------------------------------------------------------------------ properties
    @property
    def version(self) -> int:
        return self._version

    @property
    def module(self) -> torch.nn.Module:
        """The (DeepSpeed-managed) HF model."""
        return self.engine.module

    # ------------------------------------------------------------------ helpers
    def _forward_logits(self, mb: MicroBatch, module: Any = None) -> torch.Tensor:
        module = self.engine if module is None else module
        if mb.packed:
            kw = packed_forward_kwargs(mb)
            if self.packed_attention == "mask":  # transformers detects the restarts of position_ids
                kw = {k: kw[k] for k in ("input_ids", "position_ids", "attention_mask")}
            out = module(**kw, use_cache=False)  # a cache would switch off transformers' packed detection
        else:
            out = module(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        return out.logits if hasattr(out, "logits") else out[0]

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX if op == "max" else self._dist.ReduceOp.SUM)
        return t.tolist()

    @torch.no_grad()
    def compute_logprobs(self, mbs: Sequence[MicroBatch]) -> list[torch.Tensor]:
        """Token logprobs (aligned with input_ids, see `ppo.token_logprobs`) of each micro-batch under the current
        weights, eval mode, no grad: the proximal policy."""
        was_training = self.engine.module.training
        self.engine.module.eval()
        try:
            return [token_logprobs(self._forward_logits(mb), mb.input_ids, self.temperature) for mb in mbs]
        finally:
            self.engine.module.train(was_training)

    @torch.no_grad()
    def compute_ref_logprobs(self, mbs: Sequence[MicroBatch]) -> list[Optional[torch.Tensor]]:
        """Token logprobs under the frozen reference model (None for each micro-batch when KL is off)."""
        if self.ref_model is None:
            return [None] * len(mbs)
        return [token_logprobs(self._forward_logits(mb, self.ref_model), mb.input_ids, self.temperature)
                for mb in mbs]

    def _advantages(self, batch: Sequence[Trajectory], rewards: torch.Tensor) -> tuple[list, int]:
        """Per-trajectory advantages (scalars, or per-token arrays with turn-level discount) and the number of
        trajectories whose turn rewards did not match their turns (they fall back to ``reward`` for every turn)."""
        gids = [t.group_id for t in batch]
        if self.turn_discount is None:
            return group_advantages(rewards, gids, std_norm=self.adv_std_norm).tolist(), 0
        returns, segs, mismatched = [], [], 0
        for t in batch:
            sg = turn_segments(t.loss_mask)
            segs.append(sg)
            if sg and len(t.turn_rewards) == len(sg):
                returns.append(discounted_turn_returns(t.turn_rewards, self.turn_discount))
            else:
                mismatched += int(bool(sg))
                returns.append(np.full(max(len(sg), 1), t.reward, np.float64))
        per_turn = turn_level_advantages(returns, gids, std_norm=self.adv_std_norm)
        out = []
        for t, sg, a in zip(batch, segs, per_turn):
            tok = np.zeros(len(t.input_ids), np.float32)
            for (s, e), v in zip(sg, a):
                tok[s:e] = v
            out.append(tok)
        return out, mismatched

    def _token_masks_and_weights(self, batch: Sequence[Trajectory]) -> tuple[list[Trajectory], Optional[list], int]:
        """Apply staleness at consumption and the loss aggregation to each trajectory: returns the trajectories
        (with stale tokens out of the loss mask when dropping), per-token weights (None if all are 1) and the
        count of stale loss tokens (older than ``version - eta``)."""
        out, weights, n_stale = [], [], 0
        need_w = self.loss_agg == "seq" or self.stale_tokens == "downweight"
        for t in batch:
            m = t.loss_mask.astype(bool).copy()
            if len(m):
                m[0] = False  # never scored (no prefix), see batching
            w = np.ones(len(m), np.float32)
            if self.eta is not None:
                lag = self._version - t.versions.astype(np.int64)
                n_stale += int((m & (lag > self.eta)).sum())
                m2, w = stale_token_weights(t.versions, m, self._version, self.eta, self.stale_tokens,
                                            self.stale_token_decay)
                if not np.array_equal(m2, m):
                    m = m2
                    t = dataclasses.replace(t, loss_mask=m.astype(np.int8))
            if self.loss_agg == "seq":
                w = w * sequence_level_weights(m)
            out.append(t)
            weights.append(w)
        return out, (weights if need_w else None), n_stale

    def _optimizer_step(self) -> float:
        """engine.step() at a gradient accumulation boundary; returns the gradient norm before clipping."""
        manual = None
        if self.zero_stage == 0 and not self.bf16:
            manual = self._grad_norm_stage0()  # client AdamW exposes no norm; grads are all-reduced here
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None or manual is not None:
            grad_norm = manual if manual is not None else float("nan")
        return float(grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm)

    def _grad_norm_stage0(self) -> float:
        sq = 0.0
        for p in self.engine.module.parameters():
            if p.grad is not None:
                sq += float(p.grad.detach().float().pow(2).sum())
        return math.sqrt(sq)

    # ------------------------------------------------------------------ training
    def train_step(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        """One decoupled-PPO optimizer step on ``batch``; returns float metrics (`METRIC_KEYS`), ``version`` += 1."""
        if len(batch) == 0:
            raise ValueError("train_step needs a non-empty batch")
        t0 = time.perf_counter()
        version_before = self._version

        rewards = torch.tensor([t.reward for t in batch], dtype=torch.float32)
        adv, turn_mismatch = self._advantages(batch, rewards)
        trajs, tok_w, n_stale = self._token_masks_and_weights(batch)
        # PPO minibatches (AReaL's ppo_n_minibatches): one proximal recompute for the whole batch, then one
        # optimizer step per minibatch, so from the second step on the decoupled ratio pi/pi_prox moves off 1 and
        # its clip bounds the update (a trust region); with one step per batch the ratio is exactly 1.
        n_mini = self.ppo_minibatches
        if n_mini > 1:  # every rank splits into the same number, and no minibatch is empty on any rank
            n_mini = min(n_mini, int(-self._all_reduce([-float(len(trajs))], op="max")[0]))
        parts = split_minibatches([len(t.input_ids) for t in trajs], n_mini)
        groups: list[list[MicroBatch]] = []
        for idx in parts:
            sub_t, sub_a = [trajs[i] for i in idx], [adv[i] for i in idx]
            sub_w = [tok_w[i] for i in idx] if tok_w is not None else None
            if self.packing:
                built = build_packed_micro_batches(sub_t, self.max_tokens_per_mb, sub_a, token_weights=sub_w)
            else:
                built = build_micro_batches(sub_t, self.max_tokens_per_mb, sub_a, pad_token_id=self.pad_token_id,
                                            token_weights=sub_w)
            groups.append([mb.to(self.device) for mb in built])
        mbs = [mb for g in groups for mb in g]
        local_mb_tokens = [float(sum(mb.n_loss_tokens for mb in g)) for g in groups]
        local_mb_seqs = [float(sum(_n_scored_seqs(mb) for mb in g)) for g in groups]
        fwd_tokens = sum(mb.padded_tokens for mb in mbs)
        real_tokens = sum(mb.real_tokens for mb in mbs)
        all_gen = np.concatenate([t.versions[t.loss_mask.astype(bool)] for t in batch]) if batch else np.zeros(0)
        vmin = float(all_gen.min()) if all_gen.size else math.inf  # staleness as received, before any drop
        vmax = float(all_gen.max()) if all_gen.size else -math.inf

        # Global (all ranks) token / sequence counts, per minibatch.
        red_counts = self._all_reduce([*local_mb_tokens, *local_mb_seqs])
        mb_tokens, mb_seqs = red_counts[:n_mini], red_counts[n_mini:]
        global_tokens = sum(mb_tokens)
        if self.world_size > 1:
            maxes = self._all_reduce([-vmin, vmax, *(float(len(g)) for g in groups)], op="max")
            vmin, vmax = -maxes[0], maxes[1]
            template = mbs[0]
            for g, m in zip(groups, maxes[2:]):  # ZeRO-2/3 reduce in every backward: equal backward counts per rank
                while len(g) < int(m):
                    g.append(template.empty_like())
            mbs = [mb for g in groups for mb in g]
        # Each rank's loss is sum/global_count * world_size: DeepSpeed averages gradients over ranks.
        counts = mb_tokens if self.loss_agg == "token" else mb_seqs
        denoms = [max(c, 1.0) / self.world_size for c in counts]

        prox = self.compute_logprobs(mbs)  # before any update: every minibatch shares one proximal policy
        refs = self.compute_ref_logprobs(mbs)
        bounds = set(itertools.accumulate(len(g) for g in groups))  # index after each minibatch's last micro-batch
        mb_denom = [d for g, d in zip(groups, denoms) for _ in g]

        self.engine.module.train()
        sums = {k: 0.0 for k in ("loss", "clip_frac", "capped_frac", "approx_kl", "entropy", "dual_clip_frac",
                                 "kl_ref")}
        imp_sum = 0.0
        kept_tokens = 0.0
        grad_norms: list[float] = []
        lr_used = float(self.optimizer.param_groups[0]["lr"])
        for i, (mb, prox_lp, ref_lp) in enumerate(zip(mbs, prox, refs)):
            last = (i + 1) in bounds
            self.engine.set_gradient_accumulation_boundary(last)
            logits = self._forward_logits(mb)
            logp = token_logprobs(logits, mb.input_ids, self.temperature)
            loss, st = decoupled_ppo_loss(
                logp,
                prox_lp,
                mb.logprobs,
                mb.advantages,
                mb.loss_mask,
                eps_clip=self.eps_clip,
                behav_imp_weight_cap=self.behav_imp_weight_cap,
                naive=self.naive_ppo,
                denominator=mb_denom[i],
                dual_clip_c=self.dual_clip_c,
                token_weights=mb.token_weights,
                ref_logp=ref_lp,
                kl_coef=self.kl_coef,
                kl_estimator=self.kl_estimator,
            )
            with torch.no_grad():
                n = float(st["n_tokens"])
                if n > 0:
                    ent = shift_right(entropy_from_logits(logits.detach(), self.temperature))
                    sums["entropy"] += float(ent[mb.loss_mask].sum())
                    for k in ("clip_frac", "capped_frac", "approx_kl", "dual_clip_frac", "kl_ref"):
                        sums[k] += float(st[k]) * n
                    kept = n * (1.0 - float(st["capped_frac"]))
                    imp_sum += float(st["imp_weight_mean"]) * kept
                    kept_tokens += kept
                sums["loss"] += float(loss.detach())  # summed over ranks below, / world_size
            self.engine.backward(loss)
            del logits, logp, loss
            if last:
                grad_norms.append(self._optimizer_step())
        self._version += 1
        grad_norm = sum(grad_norms) / len(grad_norms)

        # Reward / advantage statistics over the global batch.
        r = rewards.double()
        a_abs_tok = sum(float(mb.advantages[mb.loss_mask].abs().sum()) for mb in mbs)  # padding micro-batches add 0
        red = self._all_reduce(
            [
                float(len(batch)),
                float(r.sum()),
                float((r**2).sum()),
                a_abs_tok,
                sums["loss"],
                sums["clip_frac"],
                sums["capped_frac"],
                sums["approx_kl"],
                sums["entropy"],
                imp_sum,
                kept_tokens,
                sums["dual_clip_frac"],
                sums["kl_ref"],
                float(n_stale),
                float(sum(int(t.loss_mask[1:].sum()) for t in batch)),
                float(fwd_tokens),
                float(real_tokens),
                float(turn_mismatch),
            ]
        )
        (n_seqs, r_sum, r_sq, a_abs, loss_sum, clip_s, cap_s, kl_s, ent_s, imp_s, kept_s, dual_s, klref_s,
         stale_s, gen_s, fwd_s, real_s, mismatch_s) = red
        tok = max(global_tokens, 1.0)
        r_mean = r_sum / n_seqs
        r_std = math.sqrt(max(r_sq / n_seqs - r_mean**2, 0.0))
        elapsed = time.perf_counter() - t0
        out = {
            "loss": loss_sum / self.world_size / n_mini,  # mean over the minibatches' losses
            "reward_mean": r_mean,
            "reward_std": r_std,
            "adv_abs_mean": a_abs / tok,
            "clip_frac": clip_s / tok,
            "imp_weight_mean": imp_s / kept_s if kept_s > 0 else 1.0,
            "capped_frac": cap_s / tok,
            "approx_kl": kl_s / tok,
            "entropy": ent_s / tok,
            "grad_norm": grad_norm,
            "n_seqs": n_seqs,
            "n_tokens": float(global_tokens),
            "head_offpolicyness": float(version_before - vmin) if math.isfinite(vmin) else 0.0,
            "tail_offpolicyness": float(version_before - vmax) if math.isfinite(vmax) else 0.0,
            "step_seconds": elapsed,
            "tokens_per_s": float(global_tokens) / elapsed if elapsed > 0 else 0.0,
            "lr": lr_used,
            "dual_clip_frac": dual_s / tok,
            "kl_ref": klref_s / tok,
            "stale_token_frac": stale_s / max(gen_s, 1.0),
            "pad_frac": 1.0 - real_s / max(fwd_s, 1.0),
        }
        if self.turn_discount is not None:
            out["turn_reward_mismatch"] = mismatch_s
        return out

    # ------------------------------------------------------------------ weights out
    def full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """The full model state dict on CPU, keys as the HF model's ``state_dict()`` (ZeRO-3: gathered; collective,
        call on every rank). Rank 0 gets the dict, other ranks None. Tensors are independent copies (tied weights
        are not shared), so the dict can be written with safetensors."""
        if self.zero_stage == 3:
            sd = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            sd = self.engine.module.state_dict() if self.rank == 0 else None
        if sd is None:
            return None
        return {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}

    def export_weights(self, path: str, dtype: Optional[torch.dtype] = None) -> None:
        """Write the full model state dict as one safetensors file, atomically (temp file in the same folder, then
        ``os.replace``). Collective under ZeRO-3; only rank 0 writes. ``dtype`` casts floating tensors (default:
        the training dtype). Metadata carries the policy version."""
        from safetensors.torch import save_file

        sd = self.full_state_dict()
        if self.rank == 0:
            assert sd is not None
            if dtype is not None:
                sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=d)
            os.close(fd)
            try:
                save_file(sd, tmp, metadata={"format": "pt", "version": str(self._version)})
                os.replace(tmp, path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        self._barrier()

    def export_hf(self, dir: str, tokenizer: Any = None) -> None:
        """``save_pretrained`` of the model (+ tokenizer) into ``dir``: written to a sibling temp folder, then
        swapped in. Collective under ZeRO-3; only rank 0 writes."""
        sd = self.full_state_dict()
        if self.rank == 0:
            dir = os.path.abspath(dir)
            parent = os.path.dirname(dir)
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".tmp-hf-", dir=parent)
            try:
                self.engine.module.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                if os.path.isdir(dir):
                    old = dir + f".old-{os.getpid()}"
                    os.replace(dir, old)
                    os.replace(tmp, dir)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.replace(tmp, dir)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        self._barrier()

    def _barrier(self) -> None:
        if self.world_size > 1:
            self._dist.barrier()

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, client_state: Optional[dict] = None, keep_last: Optional[int] = None) -> str:
        """DeepSpeed checkpoint (weights, optimizer, LR scheduler, engine counters) under ``path`` with tag
        ``v{version}``; returns the tag directory. Collective.

        Besides DeepSpeed's files, the tag directory holds `CHECKPOINT_STATE_FILE` (JSON: version plus
        ``client_state``, e.g. the data position and staleness counters) so the launcher can read where to resume
        without torch. It is written before DeepSpeed's ``latest`` pointer, which is the commit point: a save cut
        short leaves ``latest`` on the previous checkpoint. The DeepSpeed client state holds the same dict and
        this rank's python/numpy/torch RNG states. ``keep_last`` prunes older tag directories (rank 0)."""
        tag = f"v{self._version}"
        state = {"version": self._version, **(client_state or {})}
        if self.rank == 0:
            os.makedirs(os.path.join(path, tag), exist_ok=True)
            tmp = os.path.join(path, tag, CHECKPOINT_STATE_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, os.path.join(path, tag, CHECKPOINT_STATE_FILE))
        self._barrier()
        rng = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        self.engine.save_checkpoint(
            path, tag=tag, client_state={"arl_version": self._version, "arl_rng": rng, "arl_state": state}
        )
        self._barrier()
        if keep_last is not None and self.rank == 0:
            tags = sorted(
                (d for d in os.listdir(path) if d.startswith("v") and d[1:].isdigit() and d != tag),
                key=lambda d: int(d[1:]),
            )
            for old in tags[: max(0, len(tags) - (keep_last - 1))]:
                shutil.rmtree(os.path.join(path, old), ignore_errors=True)
        return os.path.join(path, tag)

    def load(self, path: str) -> dict:
        """Load the checkpoint ``latest`` points to under ``path`` (weights, optimizer, LR scheduler, version,
        RNG). Returns the ``client_state`` given to `save` (empty for older checkpoints). Collective."""
        load_path, client = self.engine.load_checkpoint(path)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint found under {path!r}")
        client = client or {}
        self._version = int(client.get("arl_version", self._version))
        rng = client.get("arl_rng")
        if rng:
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        state = dict(client.get("arl_state") or {})
        state.pop("version", None)
        return state


def learner_from_config(model: torch.nn.Module, cfg: Any, version: int = 0) -> DeepSpeedLearner:
    """A `DeepSpeedLearner` with the settings of an `ExperimentConfig` (learner.*, gen.temperature, seed, eta,
    total_train_steps for the LR schedule)."""
    lc = cfg.learner
    return DeepSpeedLearner(
        model,
        lr=lc.optimizer.lr,
        betas=tuple(lc.optimizer.betas),
        weight_decay=lc.optimizer.weight_decay,
        grad_clip=lc.optimizer.grad_clip,
        zero_stage=lc.deepspeed.zero_stage,
        offload_optimizer=lc.deepspeed.offload_optimizer,
        bf16=lc.deepspeed.bf16,
        max_tokens_per_mb=lc.deepspeed.max_tokens_per_mb,
        eps_clip=lc.ppo.eps_clip,
        behav_imp_weight_cap=lc.ppo.behav_imp_weight_cap,
        naive_ppo=lc.ppo.naive_ppo,
        ppo_minibatches=lc.ppo.minibatches,
        adv_std_norm=lc.ppo.adv_std_norm,
        temperature=cfg.gen.temperature,
        version=version,
        seed=cfg.seed,
        packing=lc.deepspeed.packing,
        packed_attention=lc.deepspeed.packed_attention,
        dual_clip_c=lc.ppo.dual_clip_c,
        loss_agg=lc.ppo.loss_agg,
        kl_coef=lc.ppo.kl_coef,
        kl_estimator=lc.ppo.kl_estimator,
        turn_discount=lc.ppo.turn_discount,
        max_head_offpolicyness=cfg.max_head_offpolicyness,
        stale_tokens=lc.ppo.stale_tokens,
        stale_token_decay=lc.ppo.stale_token_decay,
        lr_schedule=lc.optimizer.lr_schedule,
        warmup_steps=lc.optimizer.warmup_steps,
        total_steps=cfg.total_train_steps * lc.ppo.minibatches,  # the schedule counts optimizer steps
        min_lr_ratio=lc.optimizer.min_lr_ratio,
    )
