"""`DeepSpeedLearner`: the learner engine (decoupled PPO with group advantages) on top of `deepspeed.initialize`.

One `train_step(batch)` is one optimizer step, whatever the number of micro-batches:

1. proximal logprobs are recomputed with the current weights (no grad, eval mode);
2. GRPO advantages from ``traj.reward`` grouped by ``traj.group_id``, broadcast over each trajectory's loss-mask
   tokens;
3. the batch is split into micro-batches by a token budget (`arl.learner.batching`); each micro-batch's loss is
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
from arl.learner.batching import MicroBatch, build_micro_batches
from arl.learner.ppo import decoupled_ppo_loss, entropy_from_logits, group_advantages, shift_right, token_logprobs

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedLearner", "ensure_distributed", "METRIC_KEYS"]

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
        for k, v in defaults.items():
            os.environ.setdefault(k, v)
    backend = None if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


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
        adv_std_norm: bool = True,
        temperature: float = 1.0,
        version: int = 0,
        seed: int = 0,
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
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.ds_config
        )
        self.device = self.engine.device

    # ------------------------------------------------------------------ properties
    @property
    def version(self) -> int:
        return self._version

    @property
    def module(self) -> torch.nn.Module:
        """The (DeepSpeed-managed) HF model."""
        return self.engine.module

    # ------------------------------------------------------------------ helpers
    def _forward_logits(self, mb: MicroBatch) -> torch.Tensor:
        out = self.engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
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
        adv = group_advantages(rewards, [t.group_id for t in batch], std_norm=self.adv_std_norm)
        mbs = [
            mb.to(self.device)
            for mb in build_micro_batches(batch, self.max_tokens_per_mb, adv.tolist(), pad_token_id=self.pad_token_id)
        ]
        n_real_mbs = len(mbs)
        local_tokens = sum(mb.n_loss_tokens for mb in mbs)
        gen_versions = torch.cat([mb.versions[mb.loss_mask] for mb in mbs])
        vmin = float(gen_versions.min()) if gen_versions.numel() else math.inf
        vmax = float(gen_versions.max()) if gen_versions.numel() else -math.inf

        # Global (all ranks) token count and micro-batch count.
        global_tokens, = self._all_reduce([float(local_tokens)])
        if self.world_size > 1:
            max_mbs, neg_vmin, vmax = self._all_reduce([float(n_real_mbs), -vmin, vmax], op="max")
            vmin = -neg_vmin
            while len(mbs) < int(max_mbs):  # ZeRO-2/3 reduce in every backward: equal backward counts per rank
                dummy = mbs[0]
                mbs.append(
                    MicroBatch(
                        input_ids=dummy.input_ids[:1],
                        attention_mask=dummy.attention_mask[:1],
                        loss_mask=torch.zeros_like(dummy.loss_mask[:1]),
                        logprobs=dummy.logprobs[:1],
                        versions=dummy.versions[:1],
                        advantages=dummy.advantages[:1],
                        seq_lens=dummy.seq_lens[:1],
                        indices=[],
                    )
                )
        # Each rank's loss is sum/global_tokens * world_size: DeepSpeed averages gradients over ranks.
        denom = max(global_tokens, 1.0) / self.world_size

        prox = self.compute_logprobs(mbs)

        self.engine.module.train()
        sums = {k: 0.0 for k in ("loss", "clip_frac", "capped_frac", "approx_kl", "entropy")}
        imp_sum = 0.0
        kept_tokens = 0.0
        grad_norm_manual: Optional[float] = None
        for i, (mb, prox_lp) in enumerate(zip(mbs, prox)):
            last = i == len(mbs) - 1
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
                denominator=denom,
            )
            with torch.no_grad():
                n = float(st["n_tokens"])
                if n > 0:
                    ent = shift_right(entropy_from_logits(logits.detach(), self.temperature))
                    sums["entropy"] += float(ent[mb.loss_mask].sum())
                    for k in ("clip_frac", "capped_frac", "approx_kl"):
                        sums[k] += float(st[k]) * n
                    kept = n * (1.0 - float(st["capped_frac"]))
                    imp_sum += float(st["imp_weight_mean"]) * kept
                    kept_tokens += kept
                sums["loss"] += float(loss.detach())  # summed over ranks below, / world_size
            self.engine.backward(loss)
            del logits, logp, loss
        if self.zero_stage == 0 and not self.bf16:
            grad_norm_manual = self._grad_norm_stage0()  # client AdamW exposes no norm; grads are all-reduced here
        self.engine.step()
        self._version += 1

        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None or (self.zero_stage == 0 and not self.bf16):
            grad_norm = grad_norm_manual if grad_norm_manual is not None else float("nan")
        grad_norm = float(grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm)

        # Reward / advantage statistics over the global batch.
        r = rewards.double()
        a_abs_tok = sum(float(mb.advantages[mb.loss_mask].abs().sum()) for mb in mbs[:n_real_mbs])
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
            ]
        )
        n_seqs, r_sum, r_sq, a_abs, loss_sum, clip_s, cap_s, kl_s, ent_s, imp_s, kept_s = red
        tok = max(global_tokens, 1.0)
        r_mean = r_sum / n_seqs
        r_std = math.sqrt(max(r_sq / n_seqs - r_mean**2, 0.0))
        elapsed = time.perf_counter() - t0
        return {
            "loss": loss_sum / self.world_size,
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
        }

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
    def save(self, path: str) -> None:
        """DeepSpeed checkpoint (weights, optimizer, engine counters) under ``path`` with tag ``v{version}`` and a
        ``latest`` pointer; the client state holds the policy version and this rank's python/numpy/torch RNG
        states. Collective."""
        rng = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        self.engine.save_checkpoint(
            path, tag=f"v{self._version}", client_state={"arl_version": self._version, "arl_rng": rng}
        )

    def load(self, path: str) -> None:
        """Load the checkpoint ``latest`` points to under ``path`` (weights, optimizer, version, RNG). Collective."""
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
