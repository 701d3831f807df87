"""Learner benchmark, side by side in one run:

1. packed vs length-grouped padded micro-batches: CPU seconds per `PPOActor.step` on a `DeepSpeedEngine`, on the
   same batch of long-tailed sequence lengths (log-normal generation lengths), same token budget per micro-batch.
   The baseline is the learner's own padded path (``learner.deepspeed.packing=false``: token-budget micro-batches,
   longest first, right padding), the strongest padded layout a user can pick; the headline is
   ``packed vs length-grouped padding: N.NNx CPU time``. ``--arrival-order`` adds a weaker reference: fixed-size
   micro-batches padded in the order the trajectories arrived, as a loader without length grouping would.
   The attention calls of a step are then replayed alone with each layout's shapes, splitting the step's CPU time
   into attention and the rest, next to the work each layout has to do (padded vs real tokens; attention
   ``B * L_max^2 / 2`` vs per-sequence causal ``sum L_i^2 / 2``), which is what bounds the ratio. Both follow the
   step's own micro-batches: the default PPO settings split the batch into minibatches first
   (``learner.ppo.minibatches``), and each minibatch is packed or padded on its own.
2. DeepSpeed vs plain torch: seconds per optimizer step of that step vs a hand-written
   plain-torch step doing the same work (same packed micro-batches, proximal-logprob recompute, decoupled PPO loss,
   entropy metric, backward, grad clipping, AdamW) on the same model and batch.

Steps of the variants alternate (A B A B ...) so machine noise hits both; medians are reported, of wall time and
of this process's CPU time (one torch thread: CPU seconds are what the step costs, and they barely move when other
processes compete for the cores, while wall seconds do). Ratios are given for both; CPU time is the figure.

    python scripts/bench_learner.py --repeats 7          # defaults (a few minutes on 2 cores)
    python scripts/bench_learner.py --tiny               # seconds: the smoke test's sizes
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl.api.engine import TrainBatch  # noqa: E402
from arl.api.types import Trajectory  # noqa: E402


def long_tailed_batch(n: int, vocab: int, prompt_len: tuple[int, int], gen_median: float, gen_sigma: float,
                      max_len: int, groups: int, seed: int = 0) -> list[Trajectory]:
    """``n`` trajectories, prompt length uniform in ``prompt_len``, generation length log-normal (long tail),
    total length capped at ``max_len``; behaviour logprobs near uniform; ``groups`` prompt groups."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        g = int(min(max_len - p, max(1, round(rng.lognormal(math.log(gen_median), gen_sigma)))))
        ids = rng.integers(1, vocab, size=p + g)
        mask = np.r_[np.zeros(p), np.ones(g)]
        lp = np.where(mask > 0, -math.log(vocab) + rng.normal(0, 0.2, p + g), 0.0)
        ver = np.where(mask > 0, 0, -1)
        out.append(Trajectory(ids, mask, lp, ver, float(rng.integers(0, 2)), f"g{i % groups}"))
    return out


def make_model(vocab: int, hidden: int, layers: int, heads: int, max_pos: int, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                                        num_hidden_layers=layers, num_attention_heads=heads,
                                        num_key_value_heads=heads, max_position_embeddings=max_pos, pad_token_id=0))


class PlainTorchLearner:
    """The learner's step in plain torch (no DeepSpeed): packed micro-batches, proximal recompute, decoupled PPO
    loss with the batch token count as denominator, entropy metric, backward, clip, AdamW."""

    def __init__(self, model: torch.nn.Module, lr: float, grad_clip: float, max_tokens_per_mb: int) -> None:
        from arl.learner.packing import enable_varlen_attention

        enable_varlen_attention(model)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99))
        self.grad_clip = grad_clip
        self.max_tokens_per_mb = max_tokens_per_mb

    def _logits(self, mb: Any) -> torch.Tensor:
        from arl.learner.packing import packed_forward_kwargs

        return self.model(**packed_forward_kwargs(mb), use_cache=False).logits

    def step(self, batch: list[Trajectory]) -> dict[str, float]:
        from arl.learner.batching import build_packed_micro_batches
        from arl.learner.ppo import (decoupled_ppo_loss, entropy_from_logits, group_advantages, shift_right,
                                     token_logprobs)

        t0 = time.perf_counter()
        adv = group_advantages(torch.tensor([t.reward for t in batch]), [t.group_id for t in batch])
        mbs = build_packed_micro_batches(batch, self.max_tokens_per_mb, adv.tolist())
        n_tok = float(sum(mb.n_loss_tokens for mb in mbs))
        self.model.eval()
        with torch.no_grad():
            prox = [token_logprobs(self._logits(mb), mb.input_ids) for mb in mbs]
        self.model.train()
        ent = 0.0
        for mb, p in zip(mbs, prox):
            logits = self._logits(mb)
            logp = token_logprobs(logits, mb.input_ids)
            loss, _ = decoupled_ppo_loss(logp, p, mb.logprobs, mb.advantages, mb.loss_mask, denominator=n_tok)
            with torch.no_grad():
                ent += float(shift_right(entropy_from_logits(logits.detach()))[mb.loss_mask].sum())
            loss.backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"step_seconds": time.perf_counter() - t0, "n_tokens": n_tok}


def alternate(fns: dict[str, Callable[[], tuple[float, float]]], repeats: int,
              warmup: int = 1) -> dict[str, dict[str, list[float]]]:
    """Call each fn ``warmup`` times, then ``repeats`` rounds of all of them in turn; wall and CPU seconds per
    call: ``{name: {"wall": [...], "cpu": [...]}}``."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    out: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            wall, cpu = f()
            out[k]["wall"].append(wall)
            out[k]["cpu"].append(cpu)
    return out


def timed(fn: Callable[[], Any]) -> Callable[[], tuple[float, float]]:
    def run() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - t0, time.process_time() - c0

    return run


def medians(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {k: {c: statistics.median(v[c]) for c in ("wall", "cpu")} for k, v in times.items()}


def padded_arrival_order_step(lrn: Any, batch: list[Trajectory], per_mb: int) -> Callable[[], Any]:
    """A step of the padded learner whose micro-batches are fixed-size slices in arrival order (no grouping)."""
    from arl.learner import batching

    orig = batching.split_by_token_budget

    def split(lengths: Any, budget: int) -> list[list[int]]:
        return [list(range(i, min(i + per_mb, len(lengths)))) for i in range(0, len(lengths), per_mb)]

    def step() -> Any:
        batching.split_by_token_budget = split
        try:
            return lrn.step(batch)
        finally:
            batching.split_by_token_budget = orig

    return step


def step_parts(lengths: np.ndarray, minibatches: int) -> list[np.ndarray]:
    """The sequence indices of each PPO minibatch of a step (`PPOActor` splits the batch before the engine builds
    micro-batches from each part)."""
    from arl.learner.actor import split_minibatches

    return [np.array(p) for p in split_minibatches(lengths.tolist(), minibatches)]


def attention_replay(lengths: np.ndarray, budget: int, heads: int, head_dim: int, layers: int,
                     repeats: int, minibatches: int = 1) -> dict[str, float]:
    """CPU seconds per step of the attention calls alone, replayed with each layout's shapes through the functions
    the model calls: per layer, one no-grad forward (proximal logprobs) and one forward + backward (the update).
    Packed: `arl.learner.packing`'s varlen attention on each bin (per-sequence causal SDPA); padded: transformers'
    causal SDPA on each right-padded micro-batch (no mask: no real token attends to a padding key). Micro-batches
    are built per PPO minibatch, as the step builds them. Medians of ``repeats`` alternating rounds."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from arl.learner.batching import pack_by_token_budget, split_by_token_budget
    from arl.learner.packing import _varlen_attention

    class Attn(torch.nn.Module):  # what the attention functions read off the module
        is_causal = True
        num_key_value_groups = 1

    mod, scale = Attn(), head_dim ** -0.5
    gen = torch.Generator().manual_seed(0)

    def qkv(b: int, n: int) -> list[torch.Tensor]:
        return [torch.randn(b, heads, n, head_dim, generator=gen).requires_grad_() for _ in range(3)]

    packed_in, padded_in = [], []
    for part in step_parts(lengths, minibatches):
        lens = lengths[part]
        for idx in pack_by_token_budget(lens.tolist(), budget):
            cu = torch.tensor(np.r_[0, np.cumsum(lens[idx])], dtype=torch.int32)
            packed_in.append((qkv(1, int(cu[-1])), {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}))
        for idx in split_by_token_budget(lens.tolist(), budget):
            padded_in.append((qkv(len(idx), int(lens[idx].max())), {}, None))

    def run(calls: list[tuple[Callable[..., Any], list[torch.Tensor], Optional[torch.Tensor], dict]]) -> None:
        for _ in range(layers):
            for fn, (q, k, v), mask, kw in calls:
                with torch.no_grad():
                    fn(mod, q, k, v, mask, scaling=scale, **kw)
                out, _ = fn(mod, q, k, v, mask, scaling=scale, **kw)
                out.sum().backward()

    packed_calls = [(_varlen_attention, t, None, kw) for t, kw in packed_in]
    padded_calls = [(sdpa_attention_forward, t, m, kw) for t, kw, m in padded_in]
    times = alternate({"packed": timed(lambda: run(packed_calls)), "padded": timed(lambda: run(padded_calls))},
                      repeats)
    return {k: v["cpu"] for k, v in medians(times).items()}


def layout_work(lengths: np.ndarray, budget: int, minibatches: int = 1) -> dict[str, dict[str, float]]:
    """Work each layout has to do for one forward pass over the step's micro-batches (built per PPO minibatch):
    tokens through the per-token layers, and causal attention score cells (padded: ``B * L_max (L_max + 1) / 2``
    per micro-batch; packed: ``L_i (L_i + 1) / 2`` per sequence)."""
    from arl.learner.batching import pack_by_token_budget, split_by_token_budget

    parts = [lengths[p] for p in step_parts(lengths, minibatches)]
    groups = [lens[g] for lens in parts for g in split_by_token_budget(lens.tolist(), budget)]
    return {
        "padded": {"tokens": float(sum(len(g) * g.max() for g in groups)),
                   "attention_cells": float(sum(len(g) * g.max() * (g.max() + 1) / 2 for g in groups)),
                   "micro_batches": float(len(groups))},
        "packed": {"tokens": float(lengths.sum()),
                   "attention_cells": float((lengths * (lengths + 1) / 2).sum()),
                   "micro_batches": float(sum(len(pack_by_token_budget(lens.tolist(), budget)) for lens in parts))},
    }


def default_run_batch(seed: int = 0, groups: int = 16, group_size: int = 8, p_correct: float = 0.45,
                      turns: int = 3, wrong_answers: int = 5) -> list[Trajectory]:
    """A batch shaped like the default run's: a+b prompts rendered by the tiny tokenizer's chat template, up to
    ``turns`` answers of the right length with the math agent's feedback turn between them, a turn correct with
    probability ``p_correct`` (greedy accuracy at the start of RL is ~0.3-0.45). A wrong turn is one of
    ``wrong_answers`` answers per prompt: a policy puts its mass on a few wrong answers, so a group's chains share
    their first turns as often as in the run (its batches' prefix trees hold 1.57-1.83x fewer positions than their
    tokens, 1.69x over the whole run, from the traces of a default run; this batch: ~1.7x)."""
    from arl.agents.common import encode_chat
    from arl.agents.math_multi_turn import DEFAULT_FEEDBACK
    from arl.data.arith import make_arith_splits
    from arl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    feedback = encode_chat(tok, [{"role": "user", "content": DEFAULT_FEEDBACK}])
    rows, _ = make_arith_splits()
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        row = rows[int(rng.integers(len(rows)))]
        prompt = encode_chat(tok, [{"role": "user", "content": row["prompt"]}])
        right = tok(row["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        wrong = [list(rng.integers(5, len(tok), size=len(row["answer"]))) + [tok.eos_token_id]
                 for _ in range(wrong_answers)]
        for k in range(group_size):
            ids, mask = list(prompt), [0] * len(prompt)
            for turn in range(turns):
                correct = rng.random() < p_correct
                answer = right if correct else wrong[int(rng.integers(len(wrong)))]
                ids, mask = ids + answer, mask + [1] * len(answer)
                if correct or turn == turns - 1:
                    break
                ids, mask = ids + feedback, mask + [0] * len(feedback)
            m = np.array(mask)
            lp = np.where(m > 0, -0.7 + rng.normal(0, 0.3, len(m)), 0.0)
            # the group's id, shared by its 8 chains: the group-normalised advantages are not all zero (as they
            # were with an id per trajectory), so the loss, its gradient and the clip are the run's
            reward = float(ids[-len(right):] == right)
            out.append(Trajectory(np.array(ids), m, lp, np.where(m > 0, 0, -1), reward, f"g{g}"))
    return out


def forward_flops(model: torch.nn.Module, lengths: Sequence[int]) -> float:
    """Multiply-adds x 2 of one forward pass over sequences of ``lengths``: every linear layer (the LM head
    included) on every token, plus causal attention's QK^T and AV (``L (L+1) / 2`` pairs per head and layer)."""
    cfg = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    tokens = float(sum(lengths))
    pairs = float(sum(n * (n + 1) / 2 for n in lengths))
    attention = 2 * 2 * pairs * cfg.hidden_size * cfg.num_hidden_layers
    return 2 * linear * tokens + attention


def tree_forward_flops(model: torch.nn.Module, owned: Sequence[int], lengths: Sequence[int]) -> float:
    """`forward_flops` of a prefix-tree row: the linear layers on its nodes only; each sequence's own nodes attend
    to its whole path (its ancestors and the own nodes before them)."""
    cfg = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    pairs = float(sum(o * (n - o) + o * (o + 1) / 2 for o, n in zip(owned, lengths)))
    return 2 * linear * float(sum(owned)) + 2 * 2 * pairs * cfg.hidden_size * cfg.num_hidden_layers


def matmul_rate(rows: int, hidden: int, inner: int, repeats: int = 50) -> float:
    """FLOP/s of this process's torch on the matmul shapes of a step (tokens x hidden @ hidden x inner and back),
    in CPU seconds (the same clock the step is measured by)."""
    a, b, c = torch.randn(rows, hidden), torch.randn(hidden, inner), torch.randn(inner, hidden)
    for _ in range(3):
        (a @ b) @ c
    c0 = time.process_time()
    for _ in range(repeats):
        (a @ b) @ c
    return repeats * 2 * 2 * rows * hidden * inner / (time.process_time() - c0)


def default_step(repeats: int) -> dict[str, Any]:
    """The default run's learner step (its model shape, DeepSpeed and PPO settings: 4 minibatches, prefix sharing)
    on `default_run_batch`, side by side with the same step on plain packed rows (``share_prefixes=False``):
    seconds per step against the FLOP time of each one's work at the measured matmul rate."""
    from arl.api.staleness import StalenessPolicy
    from arl.config import DeepSpeedConfig, OptimizerConfig, PPOConfig
    from arl.learner.actor import PPOActor
    from arl.learner.deepspeed_engine import DeepSpeedEngine
    from arl.models.tiny import build_char_tokenizer, build_tiny_model

    model = build_tiny_model(len(build_char_tokenizer()))
    batches = [default_run_batch(seed) for seed in range(4)]
    actors = {name: PPOActor(DeepSpeedEngine(copy.deepcopy(model), OptimizerConfig(),
                                             DeepSpeedConfig(share_prefixes=name == "shared")),
                             PPOConfig(), staleness=StalenessPolicy(2)) for name in ("shared", "plain")}
    # the work: per minibatch, every linear layer on every position the model runs, plus causal attention (a tree
    # node attends to its path), three times (update forward, backward x 2) and once more for the proximal
    # recompute of every minibatch but the first (its proximal logprobs are its update forward's). The LM head is
    # counted on every position (the engine runs it on the scored ones only: ~2% of the FLOPs, an upper bound)
    actor = actors["shared"]
    parts = actor.prepare(batches[0]).minibatches
    work = {"plain": 0.0, "shared": 0.0}
    positions = 0
    for j, part in enumerate(parts):
        passes = 3 + (j > 0)
        trajs = [batches[0][i] for i in part]
        work["plain"] += passes * forward_flops(model, [len(t.input_ids) for t in trajs])
        mbs = actor.engine._micro_batches(TrainBatch(trajs))
        work["shared"] += passes * sum(tree_forward_flops(model, mb.node_owned.tolist(), mb.seq_lens.tolist())
                                       if mb.shares_prefixes else forward_flops(model, mb.seq_lens.tolist())
                                       for mb in mbs)
        positions += sum(mb.computed_tokens for mb in mbs)
    steps = {name: iter(range(1 << 30)) for name in actors}
    clip: dict[str, list[float]] = {name: [] for name in actors}

    def one(name: str) -> Callable[[], Any]:
        return lambda: clip[name].append(actors[name].step(batches[next(steps[name]) % len(batches)])["clip_frac"])

    times = alternate({name: timed(one(name)) for name in actors}, repeats)
    lens = [len(t.input_ids) for t in batches[0]]
    cfg = model.config
    rate = matmul_rate(sum(lens) // PPOConfig().minibatches, cfg.hidden_size, cfg.intermediate_size)
    return {"tokens": sum(lens), "positions": positions, "loss_tokens": int(sum(t.loss_mask.sum() for t in batches[0])),
            "flops": work["shared"], "flops_plain": work["plain"], "matmul_flops_per_s": rate,
            "cpu": statistics.median(times["shared"]["cpu"]), "wall": statistics.median(times["shared"]["wall"]),
            "cpu_plain": statistics.median(times["plain"]["cpu"]), "wall_plain": statistics.median(times["plain"]["wall"]),
            "clip_frac": statistics.fmean(clip["shared"])}


def print_default_step(repeats: int) -> dict[str, Any]:
    """Section 3: time `default_step` and print its lines."""
    from arl.config import PPOConfig

    d = default_step(repeats)
    flop_s, flop_plain = d["flops"] / d["matmul_flops_per_s"], d["flops_plain"] / d["matmul_flops_per_s"]
    print(f"\n3. the default run's step (its model, DeepSpeed and PPO settings, {PPOConfig().minibatches} minibatches) "
          f"on a batch shaped like its own: {d['tokens']:,} tokens ({d['loss_tokens']} generated), "
          f"{d['positions']:,} positions run with shared prefixes; matmul rate {d['matmul_flops_per_s'] / 1e9:.0f} "
          f"GFLOP/s; median of {repeats} steps, alternating:")
    print(f"   shared prefixes (default): cpu {d['cpu']:.3f} s, wall {d['wall']:.3f} s, {d['flops'] / 1e9:.1f} GFLOP "
          f"-> FLOP time {flop_s:.3f} s; clip_frac {d['clip_frac']:.4f} (mean: the clip binds)")
    print(f"   plain packed rows:         cpu {d['cpu_plain']:.3f} s, wall {d['wall_plain']:.3f} s, "
          f"{d['flops_plain'] / 1e9:.1f} GFLOP -> FLOP time {flop_plain:.3f} s")
    print(f"prefix sharing: {d['cpu_plain'] / d['cpu']:.2f}x less CPU per step than plain packed rows")
    print(f"learner step: {d['cpu']:.3f} s, {100 * d['cpu'] / flop_s:.0f}% of its FLOP time at the measured matmul "
          f"rate ({100 * d['cpu'] / flop_plain:.0f}% of the plain rows' FLOP time)")
    return {"default_step": {**d, "flop_seconds": flop_s, "flop_seconds_plain": flop_plain}}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=128, help="trajectories per batch")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 48])
    ap.add_argument("--gen-median", type=float, default=48.0)
    ap.add_argument("--gen-sigma", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-tokens-per-mb", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arrival-order", action="store_true",
                    help="also time padding in arrival order (fixed-size micro-batches, no length grouping)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the profiled attention / other split")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--default-step-only", action="store_true", help="only section 3: the default run's step")
    args = ap.parse_args(argv)
    if args.tiny:
        args.seqs, args.groups, args.vocab, args.hidden, args.layers = 12, 3, 32, 32, 1
        args.prompt_len, args.gen_median, args.max_len, args.max_tokens_per_mb, args.repeats = [2, 4], 6.0, 64, 96, 1
    torch.set_num_threads(args.threads)
    if args.default_step_only:
        return print_default_step(args.repeats)
    from arl.config import DeepSpeedConfig, OptimizerConfig, PPOConfig
    from arl.learner.actor import PPOActor
    from arl.learner.deepspeed_engine import DeepSpeedEngine

    batch = long_tailed_batch(args.seqs, args.vocab, tuple(args.prompt_len), args.gen_median, args.gen_sigma,
                              args.max_len, args.groups)
    lens = np.array([len(t.input_ids) for t in batch])
    real = int(lens.sum())
    base = make_model(args.vocab, args.hidden, args.layers, args.heads, args.max_len)
    n_params = sum(p.numel() for p in base.parameters())

    def ds_actor(packing: bool) -> PPOActor:
        engine = DeepSpeedEngine(copy.deepcopy(base), OptimizerConfig(lr=1e-5, grad_clip=1.0),
                                 # packing against padding alone: this batch's random prompts share nothing, and
                                 # sharing would also place whole groups per minibatch (section 3 times sharing)
                                 DeepSpeedConfig(max_tokens_per_mb=args.max_tokens_per_mb, packing=packing,
                                                 share_prefixes=False))
        return PPOActor(engine, PPOConfig())

    packed, padded = ds_actor(packing=True), ds_actor(packing=False)
    per_mb = max(1, args.max_tokens_per_mb // int(lens.max()))
    # same peak micro-batch size as the budget allows for the longest sequence
    plain = PlainTorchLearner(copy.deepcopy(base), lr=1e-5, grad_clip=1.0, max_tokens_per_mb=args.max_tokens_per_mb)

    print(f"model: Llama hidden {args.hidden} x {args.layers} layers, {n_params:,} parameters, vocab {args.vocab}; "
          f"{args.threads} torch thread(s)")
    print(f"batch: {len(batch)} sequences, {real:,} tokens; lengths min {lens.min()} median {int(np.median(lens))} "
          f"p90 {int(np.percentile(lens, 90))} max {lens.max()} (log-normal generation, sigma {args.gen_sigma}); "
          f"micro-batch budget {args.max_tokens_per_mb} tokens")

    pad_info: dict[str, Any] = {}

    def record(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            m = fn()
            pad_info[name] = m.get("pad_frac", 0.0)
            return m

        return run

    steps: dict[str, Callable[[], Any]] = {
        "packed": record("packed", lambda: packed.step(batch)),
        "padded": record("padded", lambda: padded.step(batch)),
    }
    if args.arrival_order:
        steps["padded_arrival"] = record("padded_arrival", padded_arrival_order_step(padded, batch, per_mb))
    times = alternate({k: timed(f) for k, f in steps.items()}, args.repeats)
    med = medians(times)
    tps = {k: {c: real / v[c] for c in v} for k, v in med.items()}
    labels = {"packed": "packed (packing=true, varlen attention)",
              "padded": "padded, length-grouped (packing=false)",
              "padded_arrival": f"padded, arrival order ({per_mb}/micro-batch)"}
    print(f"\n1. packed vs padded (PPOActor.step on DeepSpeedEngine, {PPOConfig().minibatches} PPO minibatches, "
          f"micro-batches built per minibatch; median of {args.repeats} steps each, alternating)")
    print(f"   {'':40s} {'cpu s':>7s} {'wall s':>7s} {'tokens/s (cpu)':>15s} {'(wall)':>8s}  padding")
    for k in steps:
        print(f"   {labels[k]:40s} {med[k]['cpu']:7.3f} {med[k]['wall']:7.3f} {tps[k]['cpu']:15.0f} "
              f"{tps[k]['wall']:8.0f}  {pad_info.get(k, 0):.1%}")
    r_pad = {c: med["padded"][c] / med["packed"][c] for c in ("wall", "cpu")}
    print(f"   packed vs length-grouped padding: {r_pad['cpu']:.2f}x CPU time ({r_pad['wall']:.2f}x wall)")
    r_arr: dict[str, float] = {}
    if args.arrival_order:
        r_arr = {c: med["padded_arrival"][c] / med["packed"][c] for c in ("wall", "cpu")}
        print(f"   (packed vs arrival-order padding: {r_arr['cpu']:.2f}x CPU time, {r_arr['wall']:.2f}x wall)")

    breakdown: dict[str, Any] = {}
    if not args.no_breakdown:
        work = layout_work(lens, args.max_tokens_per_mb, PPOConfig().minibatches)
        att = attention_replay(lens, args.max_tokens_per_mb, args.heads, args.hidden // args.heads, args.layers,
                               args.repeats, PPOConfig().minibatches)
        rest = {k: med[k]["cpu"] - att[k] for k in ("packed", "padded")}
        breakdown = {"work": work, "attention_cpu_s": att, "other_cpu_s": rest}
        print("\n   where the CPU time goes: attention calls replayed alone with each layout's shapes (median of "
              f"{args.repeats}), the rest of the step is everything else")
        print(f"   {'':8s} {'attention s':>11s} {'rest s':>7s} {'share':>6s}  {'tokens':>7s}  {'micro-batches':>13s}"
              "  attention cells/forward")
        for k in ("packed", "padded"):
            print(f"   {k:8s} {att[k]:11.3f} {rest[k]:7.3f} {att[k] / med[k]['cpu']:6.0%}  "
                  f"{work[k]['tokens']:7,.0f}  {work[k]['micro_batches']:13.0f}  {work[k]['attention_cells']:,.0f}")
        print(f"   padded / packed: attention {att['padded'] / att['packed']:.2f}x CPU for "
              f"{work['padded']['attention_cells'] / work['packed']['attention_cells']:.2f}x the cells; rest "
              f"{rest['padded'] / rest['packed']:.2f}x CPU for {work['padded']['tokens'] / work['packed']['tokens']:.2f}x"
              " the tokens")

    ds_plain = alternate({
        "deepspeed": timed(lambda: packed.step(batch)),
        "plain": timed(lambda: plain.step(batch)),
    }, args.repeats)
    med2 = medians(ds_plain)
    ratio = {c: med2["deepspeed"][c] / med2["plain"][c] for c in ("wall", "cpu")}
    print(f"\n2. DeepSpeed (ZeRO 0, gloo) vs plain torch, same packed batch, median of {args.repeats} steps: "
          f"cpu {med2['deepspeed']['cpu']:.3f} vs {med2['plain']['cpu']:.3f} s/step -> {ratio['cpu']:.3f}x; "
          f"wall {med2['deepspeed']['wall']:.3f} vs {med2['plain']['wall']:.3f} -> {ratio['wall']:.3f}x "
          "(target <= 1.1)")
    result = {
        "params": n_params, "seqs": len(batch), "tokens": real, "len_max": int(lens.max()),
        "len_median": float(np.median(lens)), "s_per_step": med, "tokens_per_s": tps,
        "pad_frac": pad_info, "packed_over_padded": r_pad, "packed_over_padded_arrival": r_arr,
        "breakdown": breakdown,
        "deepspeed_s": med2["deepspeed"], "plain_s": med2["plain"], "deepspeed_over_plain": ratio,
        "raw": {"packing": times, "deepspeed_vs_plain": ds_plain},
    }
    result.update(print_default_step(args.repeats))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
