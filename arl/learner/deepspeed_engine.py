"""`DeepSpeedEngine`: forward/backward/step, checkpoints and weight export of one HF causal LM through DeepSpeed.

It knows nothing of PPO: an algorithm (`arl.learner.actor.PPOActor`) hands it a `TrainBatch` and a loss function.
One `train_batch` is one optimizer step, whatever the number of micro-batches:

1. the batch is split into micro-batches by a token budget (`arl.learner.batching`): packed without padding by
   default (``packing=True``, see `arl.learner.packing`), right-padded otherwise;
2. each micro-batch's loss is ``loss_fn(logits, mb, denominator)`` with ``denominator`` = the sum of
   ``loss_weight_fn`` over the micro-batches of every rank, divided by the data-parallel world size (DeepSpeed
   averages gradients over ranks), so the accumulated gradient is that of the global weighted mean, independent
   of how the batch was split;
3. one ``engine.step()``.

Gradient-accumulation boundary. DeepSpeed is configured with ``train_micro_batch_size_per_gpu=1`` and
``gradient_accumulation_steps=1`` and keeps its default *managed* accumulation mode, so ``engine.backward`` does
not rescale the loss (it divides by GAS = 1). The number of micro-batches varies per step, so the boundary is set by
hand before every backward with ``engine.set_gradient_accumulation_boundary(is_last)``: ``False`` for all but the
last micro-batch (gradients accumulate locally; stage 0/1 defer the all-reduce, stage 2/3 reduce into their
partitioned buffers), ``True`` for the last (stage 0/1 all-reduce, ZeRO finalises). ``engine.step()`` is then
called once; DeepSpeed sees the boundary flag and runs clipping + the optimizer. With several ranks, ZeRO-2/3 issue
collectives in every backward (ZeRO-3 in every forward too), so ranks must run the same number of micro-batches:
the engine all-reduces the maximum count and pads with empty micro-batches (zero loss, still a backward). (DeepSpeed
0.19.8 also has ``managed_gradient_accumulation=False`` where every ``step()`` is the boundary; it refuses
``overlap_comm`` with stages 1/3, so the documented ``set_gradient_accumulation_boundary`` path is used instead.)

Distributed setup: without RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK in the environment the engine sets
single-process defaults (a free local port) before ``deepspeed.init_distributed`` -- DeepSpeed otherwise tries MPI
discovery. The backend is gloo on CPU and DeepSpeed's default (nccl) on GPU.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import inspect
import json
import logging
import math
import os
import random
import tempfile
from datetime import timedelta
from typing import Any, Optional

import numpy as np
import torch

from arl.api.engine import LossFn, LossWeightFn, TrainBatch
from arl.config import DeepSpeedConfig, LoraConfig, LRSchedule, OptimizerConfig, PackedAttention
from arl.learner.batching import MicroBatch, build_micro_batches, scored_view
from arl.learner.checkpoint import CHECKPOINT_STATE_FILE, prune_checkpoints, replacing_file
from arl.learner.packing import VARLEN_ATTENTION, enable_varlen_attention, packed_forward_kwargs
from arl.learner.ppo import token_logprobs
from arl.utils.attention import avoid_per_shape_attention
from arl.utils.net import free_port

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedEngine", "ensure_distributed", "lr_lambda"]

# A lone rank's file rendezvous that has not completed within this long is broken: fail, do not hang.
_INIT_TIMEOUT_S = 600.0
_DIST_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def skip_shm_comm_build() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory comm op when it sets up torch.distributed.

    On the CPU accelerator ``deepspeed.comm``'s backend probes every op (compiler subprocesses) and builds
    ``deepspeed_shm_comm`` with gcc at its first ``init_distributed`` on a machine: 25-70 s before a learner can
    register, repeated on every new machine. That op serves only ``inference_all_reduce`` (DeepSpeed's
    tensor-parallel inference); training's collectives (gradient all-reduce, ZeRO's gathers) go through
    torch.distributed (gloo on CPU, NCCL on GPU) whether it exists or not, so a learner never needs it.
    """
    import importlib

    # by module path: `import deepspeed.comm.torch as m` would resolve the attribute `torch` of deepspeed.comm,
    # which is PyTorch itself
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_torch_comm, "build_shm_op"):
        ds_torch_comm.build_shm_op = lambda: None


def destroy_distributed() -> None:
    """Tear down torch.distributed and DeepSpeed's cached groups while the interpreter is whole.

    Left to interpreter finalization, gloo's worker threads can still hold work (tensors with Python references)
    when the process groups are destructed: the process then aborts at exit ("terminate called without an active
    exception", SIGABRT) after it has done its job -- a learner's exit code lies and a test that checks it fails
    now and then. DeepSpeed keeps its own reference to a world group (``deepspeed.utils.groups._WORLD_GROUP``), so
    its ``destroy_process_group`` (which releases that too) comes first.
    """
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        return
    with contextlib.suppress(Exception):
        import deepspeed.comm as ds_comm

        if ds_comm.is_initialized():
            ds_comm.destroy_process_group()
    if tdist.is_initialized():
        tdist.destroy_process_group()


def ensure_distributed() -> None:
    """Initialise torch.distributed through DeepSpeed if nobody has; single-process defaults when no launcher set
    the environment (RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR=127.0.0.1, a free MASTER_PORT)."""
    import deepspeed
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return
    skip_shm_comm_build()
    # Should DeepSpeed JIT-build an op after all, builds for different torch versions (another virtualenv on the
    # same machine) share the default folder and replace each other's .so, so a process can find it half-rebuilt
    # and fail to import it: keep one folder per torch version.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.expanduser("~/.cache/torch_extensions"),
                                                               f"torch-{torch.__version__}"))
    added = [k for k in _DIST_ENV if k not in os.environ]
    if added and os.environ.get("WORLD_SIZE", "1") != "1":
        raise RuntimeError(f"partial distributed environment (WORLD_SIZE>1 but {added} unset)")
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for k in added:
        os.environ[k] = defaults[k] if k in defaults else str(free_port())
    backend = None if torch.cuda.is_available() else "gloo"
    # A lone rank with a made-up address rendezvous through a private file, not a TCP port: a port picked free
    # can be taken by another process before the store binds it, and a TCPStore that meets a stranger's socket
    # waits in native code (deaf to SIGTERM) for the whole timeout.
    init_method = None
    if "MASTER_PORT" in added:
        fd, store = tempfile.mkstemp(prefix="arl-dist-")
        os.close(fd)
        os.unlink(store)
        init_method = f"file://{store}"
    try:
        # Only the lone rank gets a short timeout: with several ranks it also bounds every collective (a rank
        # waiting while rank 0 writes a large checkpoint), so it stays torch's default there.
        lone = {"rank": 0, "world_size": 1, "timeout": timedelta(seconds=_INIT_TIMEOUT_S)} if init_method else {}
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                                   init_method=init_method, **lone)
        if backend == "gloo":
            # local on gloo; NCCL's teardown can wait on peers still in a collective after a crash, so the
            # GPU path keeps torch's default (a warning at exit)
            atexit.register(destroy_distributed)
    finally:
        # The rendezvous address we made up is this process's business: a child process (a test, a benchmark
        # or the launcher starting its own learner) must not inherit MASTER_PORT and try to bind it again.
        # RANK / WORLD_SIZE / LOCAL_RANK stay: DeepSpeed reads LOCAL_RANK whenever an engine is created.
        for k in ("MASTER_ADDR", "MASTER_PORT"):
            if k in added:
                os.environ.pop(k, None)


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0):
    """LR multiplier per optimizer step ``k`` (0-based): linear warm-up over ``warmup_steps`` (from ``1/warmup``
    to 1), then ``constant``, ``linear`` decay or ``cosine`` decay down to ``min_lr_ratio`` at ``total_steps``."""
    schedule = LRSchedule(schedule)  # ValueError on an unknown name
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



class DeepSpeedEngine:
    """A HF causal LM trained through DeepSpeed (implements `arl.api.engine.TrainEngine`).

    Args:
        model: a HF causal LM (``model(input_ids=..., attention_mask=...).logits``); DeepSpeed takes it over.
        optimizer: client ``torch.optim.AdamW`` settings (no compiled DeepSpeed op needed), gradient clipping
            (DeepSpeed ``gradient_clipping``, 0 disables) and the LR multiplier per optimizer step (`lr_lambda`),
            handed to DeepSpeed as its LR scheduler (saved and restored with checkpoints).
        deepspeed: ZeRO stage (optimizer offload to CPU needs stage >= 1), bf16 (weights/activations in bf16, fp32
            master weights in the optimizer), the token budget of a micro-batch and packing: padding-free
            micro-batches (budget = real tokens) instead of right-padded ones (budget = padded tokens), with
            ``packed_attention`` ``varlen`` (per-sequence SDPA, see `arl.learner.packing`) or ``mask``
            (transformers' block-diagonal mask from restarting position ids).
        seed: seeds python/numpy/torch RNGs of this process. total_optimizer_steps: where the LR schedule ends.
        version: policy version of the initial weights.
        reference: keep a frozen copy of ``model`` as given (the initial weights) for
            ``forward_logprobs(..., reference=True)`` (a KL penalty). With LoRA no copy: the reference is the base
            model with the adapters disabled.
        lora: ``rank > 0`` wraps ``model`` with peft adapters (`arl.learner.lora`): only they train (the optimizer
            holds state for them alone), checkpoints hold only them (plus optimizer, scheduler, RNG), and
            `full_state_dict` / `export_weights` give the adapter payload (`arl.weights.adapter`), not the model.
        device: where the model must land: ``auto`` (DeepSpeed's accelerator: GPU ``LOCAL_RANK`` when CUDA is
            visible, else the CPU), ``cuda`` or ``cpu`` (the same placement, checked: a GPU run that would silently
            train on the CPU fails here instead).
    """

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerConfig, deepspeed: DeepSpeedConfig, *,
                 seed: int = 0, total_optimizer_steps: int = 1, version: int = 0, reference: bool = False,
                 device: str = "auto", lora: Optional[LoraConfig] = None) -> None:
        import deepspeed as ds

        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"learner device must be auto, cpu or cuda, got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("learner.device=cuda, but torch sees no CUDA device (torch "
                               f"{torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        self.cfg = deepspeed  # the section checked its own fields
        lr_fn = lr_lambda(optimizer.lr_schedule, optimizer.warmup_steps, total_optimizer_steps, optimizer.min_lr_ratio)
        self.version = int(version)
        # a prefix tree needs the per-sequence attention of `arl.learner.packing` (flash attention keeps its own)
        self.share_prefixes = False
        if deepspeed.packing and deepspeed.packed_attention == PackedAttention.varlen:
            self.share_prefixes = enable_varlen_attention(model) == VARLEN_ATTENTION and deepspeed.share_prefixes
        # seeded before the adapters are made: their initialisation is the seed's, not the caller's RNG state
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.lora = lora is not None and lora.rank > 0
        params: list[Any]  # AdamW's parameters or groups: the trainable ones at one rate, or LoRA's two groups
        if self.lora:
            from arl.learner.lora import param_groups, wrap_lora

            model = wrap_lora(model, lora)  # the reference is the base with the adapters off: no copy
            params = param_groups(model, optimizer.lr, lora.lr_scale)
            logger.info("LoRA: adapters train at lr %g (learner.optimizer.lr %g x learner.lora.lr_scale %g)",
                        optimizer.lr * lora.lr_scale, optimizer.lr, lora.lr_scale)
        else:
            params = [p for p in model.parameters() if p.requires_grad]
        self.reference = bool(reference)
        self.ref_model = (copy.deepcopy(model).eval().requires_grad_(False)  # varlen too
                          if reference and not self.lora else None)
        if deepspeed.bf16 and deepspeed.zero_stage == 0:
            # DeepSpeed 0.19.8 wraps bf16 + stage 0 + a client optimizer in FP16_UnfusedOptimizer, which
            # accumulates gradients in bf16; stage >= 1 uses fp32 gradient accumulation.
            logger.warning("bf16 with zero_stage=0 accumulates gradients in bf16; prefer zero_stage>=1 with bf16")

        ensure_distributed()
        import deepspeed.comm as dist

        self._dist = dist
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.grad_clip = float(optimizer.grad_clip)
        self._clips_itself = deepspeed.zero_stage == 0 and not deepspeed.bf16
        zero: dict[str, Any] = {"stage": deepspeed.zero_stage}
        if deepspeed.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if deepspeed.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        self.ds_config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            # ZeRO-0 fp32: the engine clips itself (`_optimizer_step`): DeepSpeed's clip would take a second norm
            # over every gradient only to drop it (its client AdamW reports none)
            "gradient_clipping": 0.0 if self._clips_itself else float(optimizer.grad_clip),
            "zero_optimization": zero,
            "bf16": {"enabled": bool(deepspeed.bf16)},
            # A client torch AdamW with ZeRO-Offload: allowed (DeepSpeedCPUAdam would JIT-compile an op).
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        self.pad_token_id = int(getattr(getattr(model, "config", None), "pad_token_id", None) or 0)
        # transformers' causal LMs run the LM head on a tensor of positions (`_forward_logits`); others give all
        hf = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._keeps_logits = "logits_to_keep" in inspect.signature(hf.forward).parameters
        # fused: one kernel over all parameters (CPU and CUDA) instead of a dozen small ops per tensor, which on a
        # small model cost more than the update itself
        adamw = torch.optim.AdamW(params, lr=optimizer.lr,
                                  betas=tuple(optimizer.betas), weight_decay=optimizer.weight_decay, fused=True)
        self.model_engine, self.optimizer, _, self.lr_scheduler = ds.initialize(
            model=model, optimizer=adamw, config=self.ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_fn),
        )
        if self.world_size == 1 and deepspeed.zero_stage == 0:
            # a lone rank's gradient all-reduce is an identity that still flattens, sends through gloo and copies
            # back every gradient once per optimizer step (ZeRO >= 1 reduces inside its optimizer: left alone)
            self.model_engine.enable_backward_allreduce = False
        # Eval mode for every forward, the update's too: with dropout in training but not in the proximal
        # recompute (or a fresh mask in each), the ratio would move off 1 before any update and the clip would
        # bound noise. RL fine-tuning trains with dropout off.
        self.model_engine.module.eval()
        # so the update's forward is the computation `forward_logprobs` does: the actor takes the first
        # minibatch's proximal logprobs from it (`PPOActor.compute_logp`) instead of a forward of their own
        self.prox_from_update = True
        self.device = torch.device(self.model_engine.device)
        avoid_per_shape_attention(self.device)  # one attention per packed sequence, in worker threads
        logger.info("DeepSpeed %s engine: ZeRO stage %d, %d rank(s), bf16 %s, on %s", ds.__version__,
                    deepspeed.zero_stage, self.world_size, bool(deepspeed.bf16), self.device)
        if device != "auto" and self.device.type != device:
            raise RuntimeError(f"learner.device={device}, but DeepSpeed placed the model on {self.device} (its "
                               "accelerator; CUDA_VISIBLE_DEVICES= or DS_ACCELERATOR=cpu picks the CPU)")
        if self.ref_model is not None:
            self.ref_model.to(self.device)

    @property
    def module(self) -> torch.nn.Module:
        """The (DeepSpeed-managed) HF model."""
        return self.model_engine.module

    # ------------------------------------------------------------------ micro-batches
    def _micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        per_token = dict(batch.fields)
        adv = per_token.pop("advantages", None)
        built = build_micro_batches(batch.trajs, self.cfg.max_tokens_per_mb, adv, packed=self.cfg.packing,
                                    share_prefixes=self.share_prefixes, pad_token_id=self.pad_token_id, **per_token)
        return [mb.to(self.device) for mb in built]

    def _equal_counts(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        """Pad with empty micro-batches to the largest count of any rank (ZeRO collectives in every pass)."""
        if self.world_size > 1:
            most = int(self.all_reduce([float(len(mbs))], op="max")[0])
            mbs = mbs + [mbs[0].empty_like() for _ in range(most - len(mbs))]
        return mbs

    def _scored(self, mb: MicroBatch) -> tuple[MicroBatch, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """What a loss reads of a packed row (`batching.scored_view`): the view, its row positions and the model
        positions whose logits it needs (a prefix tree's nodes); a padded micro-batch is read whole."""
        if not mb.packed:
            return mb, None, None
        view, pos = scored_view(mb)
        return view, pos, (mb.node_index.index_select(0, pos) if mb.shares_prefixes else pos)

    def _forward_logits(self, mb: MicroBatch, module: Any = None, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The logits of a micro-batch in its row layout, or with ``keep`` (a packed row's model positions, see
        `_scored`) at those positions only: the LM head runs on them alone where the model takes a tensor
        ``logits_to_keep`` (transformers' causal LMs)."""
        module = self.model_engine if module is None else module
        if mb.packed:
            kw = packed_forward_kwargs(mb)
            if self.cfg.packed_attention == PackedAttention.mask:  # transformers detects the restarts of position_ids
                kw = {k: kw[k] for k in ("input_ids", "position_ids", "attention_mask")}
            if keep is not None and self._keeps_logits:
                kw["logits_to_keep"] = keep
            out = module(**kw, use_cache=False)  # a cache would switch off transformers' packed detection
        else:
            # Right padding under a causal mask: no real token attends to a padding key (they all come after it),
            # so the padding mask changes nothing the loss or the logprobs read, while passing it makes transformers
            # build a [B, 1, L, L] mask and SDPA attend to every cell of it (no causal skip): 2x the attention
            # work and a mask conversion per layer. Without it SDPA runs causal; padding positions' outputs differ
            # but are never read (off the loss mask, cut from the logprobs).
            out = module(input_ids=mb.input_ids, use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]
        if keep is not None:
            return logits if self._keeps_logits else logits.index_select(1, keep)
        # a prefix tree's logits, back in the row's layout (a node's at each of its positions)
        return logits.index_select(1, mb.node_index) if mb.shares_prefixes else logits

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX if op == "max" else self._dist.ReduceOp.SUM)
        return t.tolist()

    # ------------------------------------------------------------------ forward / backward / step
    @torch.no_grad()
    def forward_logprobs(self, batch: TrainBatch, temperature: float = 1.0, reference: bool = False,
                         scored_only: bool = False) -> list[np.ndarray]:
        """Token logprobs of each trajectory (aligned with input_ids, see `ppo.token_logprobs`) under the current
        weights (or the frozen reference model), no grad, in eval mode like every forward of this engine.
        ``scored_only``: only at the positions the trajectories' loss masks score (0 elsewhere; packed rows)."""
        if reference and not self.reference:
            raise ValueError("this engine keeps no reference model (build it with reference=True)")
        module = self.ref_model if reference and self.ref_model is not None else self.model_engine
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(batch)
        for mb in self._equal_counts(self._micro_batches(TrainBatch(batch.trajs))):  # only the tokens
            view, pos, keep = self._scored(mb) if scored_only else (mb, None, None)
            with self._reference_context(reference):
                logits = self._forward_logits(mb, module, keep)
            lp = token_logprobs(logits, view.input_ids, temperature)
            if pos is not None:  # back to the row, 0 where nothing is scored (the kept predecessors included)
                lp = torch.zeros(mb.input_ids.shape, dtype=lp.dtype, device=lp.device).index_copy_(
                    1, pos, lp.masked_fill(~view.loss_mask, 0.0))
            lp = lp.cpu().numpy()
            lens = mb.seq_lens.tolist()
            rows = np.split(lp[0], np.cumsum(lens)[:-1]) if mb.packed else [r[:n] for r, n in zip(lp, lens)]
            for i, row in zip(mb.indices, rows):
                out[i] = row
        return out

    def _reference_context(self, reference: bool) -> Any:
        """With LoRA, the reference forward runs the base model: the adapters disabled for its duration."""
        if reference and self.lora:
            from arl.learner.lora import reference_context

            return reference_context(self.model_engine.module)
        return contextlib.nullcontext()

    def train_batch(self, batch: TrainBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """One optimizer step over ``batch`` (see the module doc); returns grad_norm (before clipping), the lr it
        used and the padded / real tokens of its micro-batches on this rank. A batch without a loss token on any
        rank takes no step (``empty_minibatches``: 1)."""
        mbs = self._micro_batches(batch)
        padded, real = sum(mb.padded_tokens for mb in mbs), sum(mb.real_tokens for mb in mbs)
        weight = self.all_reduce([float(sum(loss_weight_fn(mb) for mb in mbs))])[0]
        lr = float(self.optimizer.param_groups[0]["lr"])
        if weight <= 0:  # every token of it dropped (on every rank: the weight is all-reduced): no step at all,
            # which with zero gradients would still move the weights by weight decay and Adam's momentum
            return {"lr": lr, "padded_tokens": float(padded), "real_tokens": float(real), "empty_minibatches": 1.0}
        mbs = self._equal_counts(mbs)
        denominator = weight / self.world_size
        for i, mb in enumerate(mbs):
            self.model_engine.set_gradient_accumulation_boundary(i == len(mbs) - 1)
            view, _, keep = self._scored(mb)  # the loss reads scored positions only (`LossFn`)
            logits = self._forward_logits(mb, keep=keep)
            loss = loss_fn(logits, view, denominator)
            self.model_engine.backward(loss)
            del logits, loss
        return {"grad_norm": self._optimizer_step(), "lr": lr, "padded_tokens": float(padded),
                "real_tokens": float(real)}

    def _optimizer_step(self) -> float:
        """engine.step() at a gradient accumulation boundary; returns the gradient norm before clipping."""
        manual = None
        if self._clips_itself:  # the gradients are all-reduced by now (DeepSpeed does it in the last backward)
            grads = [p for p in self.model_engine.module.parameters() if p.grad is not None]
            # clip_grad_norm_ with max_norm=inf measures without scaling (0 disables clipping, as in DeepSpeed)
            manual = float(torch.nn.utils.clip_grad_norm_(grads, self.grad_clip if self.grad_clip > 0 else math.inf))
        self.model_engine.step()
        norm = manual if manual is not None else self.model_engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    # ------------------------------------------------------------------ weights out
    def full_state_dict(self, copy: bool = True) -> Optional[dict[str, torch.Tensor]]:
        """The full model state dict on CPU, keys as the HF model's ``state_dict()`` (ZeRO-3: gathered; collective,
        call on every rank). Rank 0 gets the dict, other ranks None. Tensors are independent copies (tied weights
        are not shared), so the dict can be written with safetensors. ``copy=False``: below ZeRO-3, the live
        parameters themselves, on their device (for a caller that copies them before the next step: the
        broadcast publisher packs them; a clone of a GB model is ~1 s of page faults on CPU). With LoRA: the
        adapter payload (`arl.weights.adapter`), names of the base model, B scaled."""
        if self.cfg.zero_stage == 3:
            sd = self.model_engine._zero3_consolidated_16bit_state_dict()
            if sd is not None and self.lora:
                from arl.learner.lora import adapter_payload

                sd = adapter_payload(self.model_engine.module, sd)
        elif self.lora:
            from arl.learner.lora import adapter_payload

            sd = adapter_payload(self.model_engine.module) if self.rank == 0 else None
            if sd is not None and not copy:
                return sd
        else:
            sd = self.model_engine.module.state_dict() if self.rank == 0 else None
            if sd is not None and not copy:
                return {k: v.detach() for k, v in sd.items()}
        if sd is None:
            return None
        return {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}

    def export_weights(self, path: str) -> None:
        """Write the full model state dict as one safetensors file, atomically (temp file in the same folder, then
        ``os.replace``), in the training dtype. Collective under ZeRO-3; only rank 0 writes. Metadata carries the
        policy version."""
        from safetensors.torch import save_file

        sd = self.full_state_dict()
        if self.rank == 0:
            assert sd is not None
            with replacing_file(path) as tmp:
                save_file(sd, tmp, metadata={"format": "pt", "version": str(self.version),
                                             "payload": "lora" if self.lora else "full"})
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
        tag = f"v{self.version}"
        state = {"version": self.version, **(client_state or {})}
        if self.rank == 0:
            with replacing_file(os.path.join(path, tag, CHECKPOINT_STATE_FILE)) as tmp, open(tmp, "w") as f:
                json.dump(state, f)
        self._barrier()
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        self.model_engine.save_checkpoint(  # LoRA: the frozen base stays out (megabytes, not the model)
            path, tag=tag, client_state={"arl_version": self.version, "arl_rng": rng, "arl_state": state},
            exclude_frozen_parameters=self.lora)
        self._barrier()
        if keep_last is not None and self.rank == 0:
            prune_checkpoints(path, keep_last, tag)
        return os.path.join(path, tag)

    def load(self, path: str, tag: Optional[str] = None) -> dict:
        """Load the checkpoint ``latest`` points to under ``path`` (or the one named ``tag``, ``v<version>``: a
        replay starts from an older one) -- weights, optimizer, LR scheduler, version, RNG. Returns the
        ``client_state`` given to `save` (empty for older checkpoints). Collective."""
        # LoRA: the checkpoint holds the trainable parameters only; the base comes from the model folder
        load_path, client = self.model_engine.load_checkpoint(path, tag=tag, load_module_strict=not self.lora)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint found under {path!r}")
        client = client or {}
        self.version = int(client.get("arl_version", self.version))
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
