"""Benchmark of the embedded engine: continuous batching vs HF `generate` on static batches, and weight-update pauses.

Measured side by side in one run, on the same model and the same requests:

* **Throughput on a long-tailed workload.** Output lengths are drawn from a heavy-tailed (Pareto) distribution
  clipped to [min_len, max_len] (default 4..256); EOS is disabled so every request produces exactly its length.
  Continuous batching (`TorchEngine`, at most `batch_size` rows, all requests submitted at once) against
  HuggingFace `model.generate` on static batches of `batch_size` requests in arrival order (a batch runs until its
  longest member is done, as static batching must). Tokens/s counts only the tokens each request asked for. A third
  line runs our engine on the same static batches, to separate the scheduling effect from the implementation.
* **Weight-update pause.** While requests are decoding, `update_weights` is called repeatedly; the pause is the
  time the decode loop stood still (read the safetensors file, copy into the model), as the engine reports it, and
  the caller-side latency (wait for the step boundary + load). For the tiny model and for a Qwen2-0.5B-shaped model
  with random weights (bf16, 494M parameters; only the update pause is measured there, generation on CPU is slow).
* **Prefix cache on multi-turn chats.** Chats shaped like the default agent's (groups of `group_size` chains
  sharing one prompt, each turn sending the whole history: the previous turns, the answer as generated and a
  feedback message) through one engine with the prefix KV cache (`inference.torch.prefix_cache_tokens`) and one
  without, alternating rounds in this process (fresh prompts each round); the figure is the process's CPU time
  per turn (`time.process_time`: both engine threads and the event loop), which a shared machine's load does not
  inflate the way it does wall time.
* **Several LoRA policies in one batch** (`TorchEngine(max_loras=N)`, `arl.inference.multi_lora`). The same
  long-tailed workload spread over N adapters (rank `--lora-rank` on the learner's default targets, q/k/v/o),
  decoded together (each row its own adapter), against the strongest one-policy path: one adapter merged into the
  weights (what the engine does with a single LoRA policy: plain weights at decode). Alternating rounds, medians;
  the line also gives one adapter served unmerged through the same slots.

Usage: python scripts/bench_engine.py [--num-requests 256 --batch-size 32 ...]; `--qwen none` skips the 0.5B part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl.api.types import GenerateRequest, GenerationConfig  # noqa: E402
from arl.inference.torch_engine import TorchEngine  # noqa: E402

# Qwen2-0.5B's shape (config.json of Qwen/Qwen2-0.5B); weights are random.
QWEN2_05B_SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, tie_word_embeddings=True, use_sliding_window=False)


def long_tailed_lengths(n: int, lo: int, hi: int, alpha: float, seed: int) -> list[int]:
    """Pareto(alpha) scaled to start at `lo`, clipped to `hi`: most requests are short, a few are very long."""
    rng = np.random.default_rng(seed)
    x = lo * (1.0 + rng.pareto(alpha, size=n))
    return [int(v) for v in np.clip(np.floor(x), lo, hi)]


def make_prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(5, vocab, size=int(rng.integers(lo, hi + 1))).astype(np.int32) for _ in range(n)]


def tiny_model(vocab: int, hidden: int, layers: int, seed: int) -> torch.nn.Module:
    from arl.models.tiny import build_tiny_model

    model = build_tiny_model(vocab, hidden_size=hidden, num_layers=layers, num_heads=4, intermediate_size=2 * hidden,
                             max_position_embeddings=1024, seed=seed, eos_token_id=None)
    model.generation_config.eos_token_id = None
    return model.eval()


def qwen2_05b_model(shape: Optional[dict] = None, device: str = "cpu",
                    dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A Qwen2 model of `shape` (default Qwen2-0.5B's, which Qwen2.5-0.5B shares) with random weights, made directly
    on `device` in `dtype`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**(shape or QWEN2_05B_SHAPE), dtype=str(dtype).removeprefix("torch."))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.to(dtype).eval()


def sync(device: Any) -> None:
    """Wait for the GPU's queued work, so a clock read after it counts it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def save_weights(model: torch.nn.Module, path: str, scale: float = 1.0) -> None:
    """Write the state dict as safetensors (tied duplicates left out, as the engine accepts)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    sd = {}
    for k, v in model.state_dict().items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        sd[k] = (v * scale if v.is_floating_point() else v).contiguous()
    save_file(sd, path)


# ----------------------------------------------------------------------------------------------- throughput

async def run_continuous(engine: TorchEngine, prompts: list[np.ndarray], lengths: list[int],
                         temperature: float) -> tuple[float, int]:
    return await run_policies(engine, prompts, lengths, [None], temperature)


async def run_engine_static(engine: TorchEngine, prompts: list[np.ndarray], lengths: list[int], batch: int,
                            temperature: float) -> tuple[float, int]:
    """Our engine fed one static batch at a time (every member runs to the batch's longest length)."""
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch):
        ps, ls = prompts[s:s + batch], lengths[s:s + batch]
        longest = max(ls)
        await asyncio.gather(*(
            engine.agenerate(GenerateRequest(qid=f"s{s}-{i}", input_ids=p,
                                             gconfig=GenerationConfig(max_new_tokens=longest, temperature=temperature)))
            for i, p in enumerate(ps)))
    return time.perf_counter() - t0, sum(lengths)


@torch.inference_mode()
def run_hf_static(model: torch.nn.Module, prompts: list[np.ndarray], lengths: list[int], batch: int,
                  temperature: float, pad_id: int) -> tuple[float, int]:
    """HF `generate` on static batches: left padding, each batch runs to its longest requested length."""
    dev = next(model.parameters()).device
    sync(dev)
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch):
        ps, ls = prompts[s:s + batch], lengths[s:s + batch]
        width = max(len(p) for p in ps)
        ids = torch.full((len(ps), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, width - len(p):] = torch.from_numpy(p.astype(np.int64))
            mask[i, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max(ls),
                             do_sample=True, temperature=temperature, top_k=0, top_p=1.0, pad_token_id=pad_id,
                             eos_token_id=None)
        assert out.shape[1] == width + max(ls), out.shape
    sync(dev)
    return time.perf_counter() - t0, sum(lengths)


# ----------------------------------------------------------------------------------------------- update pause

async def run_chats(engine: TorchEngine, *, groups: int, group_size: int, turns: int, prompt_len: int,
                    feedback_len: int, max_new: int, vocab: int, seed: int) -> dict[str, Any]:
    """`groups` x `group_size` concurrent chats of `turns` turns (temperature 1, no eos: every answer is
    `max_new` tokens); the process's CPU seconds and the engine's prefill counters over them."""
    rng = np.random.default_rng(seed)
    feedback = rng.integers(5, vocab, size=feedback_len).tolist()
    prompts = [rng.integers(5, vocab, size=prompt_len).tolist() for _ in range(groups)]
    gconfig = GenerationConfig(n=1, max_new_tokens=max_new, temperature=1.0)

    async def chain(ids: list[int], key: str) -> None:
        for t in range(turns):
            r = await engine.agenerate(GenerateRequest(qid=f"{key}/{t}", input_ids=np.asarray(ids, np.int32),
                                                       gconfig=gconfig))
            assert r.error is None, r.error
            ids = ids + r.samples[0].output_ids.tolist() + feedback

    before = engine.stats()
    t0 = time.process_time()
    await asyncio.gather(*(chain(list(p), f"{i}/{j}") for i, p in enumerate(prompts) for j in range(group_size)))
    cpu = time.process_time() - t0
    after = engine.stats()
    return {"cpu_s": cpu, "turns": groups * group_size * turns,
            **{k: after[k] - before[k] for k in ("prefill_tokens", "prefill_forwards", "decode_forwards")}}


async def alternate_chats(model: torch.nn.Module, args: argparse.Namespace,
                          cases: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, TorchEngine]]:
    """The multi-turn chats through one engine per case (`cases`: name -> TorchEngine keyword arguments), rounds
    alternating their order; per case the CPU per turn of each round and the median counters. The engines are
    returned closed, for their stats."""
    shape = dict(groups=args.chat_groups, group_size=args.chat_group_size, turns=args.chat_turns,
                 prompt_len=args.chat_prompt_len, feedback_len=args.chat_feedback_len, max_new=args.chat_max_new,
                 vocab=args.vocab)
    max_ctx = args.chat_prompt_len + args.chat_turns * (args.chat_max_new + args.chat_feedback_len) + 1
    engines = {name: TorchEngine(model, pad_token_id=0, eos_token_id=None, max_batch_size=args.chat_batch_size,
                                 max_context_len=max_ctx, seed=args.seed, name=f"bench-{name}", **kw)
               for name, kw in cases.items()}
    names = list(cases)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        for engine in engines.values():  # warm-up (first-call allocations)
            await run_chats(engine, **{**shape, "groups": 1}, seed=10_000)
        for k in range(args.chat_rounds):
            for name in (names if k % 2 == 0 else names[::-1]):
                runs[name].append(await run_chats(engines[name], **shape, seed=args.seed + k))
    finally:
        for engine in engines.values():
            await engine.close()
    out: dict[str, Any] = {"shape": shape, "rounds": args.chat_rounds}
    for name, rs in runs.items():
        out[name] = {"cpu_ms_per_turn": [1000 * r["cpu_s"] / r["turns"] for r in rs],
                     "prefill_tokens_per_turn": statistics.median(r["prefill_tokens"] / r["turns"] for r in rs),
                     "prefill_forwards": statistics.median(r["prefill_forwards"] for r in rs),
                     "decode_forwards": statistics.median(r["decode_forwards"] for r in rs)}
        out[name]["cpu_ms_per_turn_median"] = statistics.median(out[name]["cpu_ms_per_turn"])
    return out, engines


async def measure_prefix_cache(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """CPU per turn of multi-turn chats with the prefix cache on and off, alternating rounds."""
    out, engines = await alternate_chats(model, args, {"on": dict(prefix_cache_tokens=args.chat_cache_tokens),
                                                       "off": dict(prefix_cache_tokens=0)})
    hits = engines["on"].stats()
    out.update(cache_tokens=args.chat_cache_tokens, prefix_hits=hits["prefix_hits"],
               prefix_hit_tokens=hits["prefix_hit_tokens"])
    out["cpu_ratio_off_vs_on"] = out["off"]["cpu_ms_per_turn_median"] / out["on"]["cpu_ms_per_turn_median"]
    return out


async def measure_lean_forward(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """CPU per turn of the same chats (prefix cache on, as the run has it) through the engine's lean forward and
    through the model's own HF forward, alternating rounds; both produce the same tokens."""
    cache = dict(prefix_cache_tokens=args.chat_cache_tokens)
    out, _ = await alternate_chats(model, args, {"lean": dict(cache, lean_forward=True),
                                                 "hf": dict(cache, lean_forward=False)})
    out["cpu_ratio_hf_vs_lean"] = out["hf"]["cpu_ms_per_turn_median"] / out["lean"]["cpu_ms_per_turn_median"]
    return out


async def measure_update_pause(engine: TorchEngine, paths: list[str], prompts: list[np.ndarray], max_new: int,
                               updates: int, settle_steps: int = 2) -> dict[str, Any]:
    """Call update_weights `updates` times while `prompts` are decoding; every request must come back whole."""
    tasks = [asyncio.create_task(engine.agenerate(GenerateRequest(
        qid=f"u{i}", input_ids=p, gconfig=GenerationConfig(max_new_tokens=max_new, temperature=1.0))))
        for i, p in enumerate(prompts)]
    stall_ms: list[float] = []
    caller_ms: list[float] = []
    in_flight: list[int] = []
    v0 = engine.version
    for k in range(updates):
        target = engine.stats()["steps"] + settle_steps
        deadline = time.monotonic() + 600
        while engine.stats()["steps"] < target and time.monotonic() < deadline:
            if all(t.done() for t in tasks):
                break  # nothing left in flight: the update still measures the swap, with no rows to keep
            await asyncio.sleep(0.001)
        in_flight.append(engine.stats()["running"])
        t0 = time.perf_counter()
        await engine.update_weights(paths[k % len(paths)], v0 + k + 1)
        caller_ms.append((time.perf_counter() - t0) * 1000)
        stall_ms.append(engine.stats()["last_update_s"] * 1000)
    resps = await asyncio.gather(*tasks)
    lost = sum(1 for r in resps if r.error is not None or len(r.samples[0].output_ids) != max_new)
    versions = sorted({int(v) for r in resps for s in r.samples for v in s.output_versions})
    return {
        "updates": updates,
        "rows_in_flight_at_update": in_flight,
        "pause_ms_all": [round(x, 3) for x in stall_ms],
        "pause_ms_median": statistics.median(stall_ms),
        "pause_ms_max": max(stall_ms),
        "caller_ms_median": statistics.median(caller_ms),
        "caller_ms_max": max(caller_ms),
        "requests": len(resps),
        "requests_lost_or_cut": lost,
        "token_versions_seen": versions,
    }


# ----------------------------------------------------------------------------------------------- multi-LoRA

def lora_payload(model: torch.nn.Module, seed: int, rank: int,
                 targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> dict[str, torch.Tensor]:
    """A random adapter payload (`arl.weights.adapter`) on `targets` of every layer."""
    from arl.weights.adapter import LORA_A, LORA_B

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            out[name + LORA_A] = torch.randn((rank, mod.in_features), generator=g) * 0.05
            out[name + LORA_B] = torch.randn((mod.out_features, rank), generator=g) * 0.05
    return out


async def run_policies(engine: TorchEngine, prompts: list[np.ndarray], lengths: list[int], policies: list,
                       temperature: float) -> tuple[float, int]:
    """Every request at once, request i under policy ``policies[i % len(policies)]``; (seconds, tokens)."""
    t0 = time.perf_counter()
    resps = await asyncio.gather(*(
        engine.agenerate(GenerateRequest(qid=str(i), input_ids=p, policy=policies[i % len(policies)],
                                         gconfig=GenerationConfig(max_new_tokens=n, temperature=temperature)))
        for i, (p, n) in enumerate(zip(prompts, lengths))))
    dt = time.perf_counter() - t0
    for r, n in zip(resps, lengths):
        assert r.error is None and len(r.samples[0].output_ids) == n, (r.error, n)
    return dt, sum(lengths)


async def measure_multi_lora(model: torch.nn.Module, prompts: list[np.ndarray], lengths: list[int],
                             args: argparse.Namespace, max_ctx: int, device: str = "cpu") -> dict[str, Any]:
    """Tokens/s of N adapters mixed in one batch vs one adapter merged (and one unmerged), alternating rounds
    (`args`: loras, lora_rank, lora_rounds, batch_size, seed, temperature)."""
    import copy

    n = args.loras
    pays = [lora_payload(model, args.seed + k, args.lora_rank) for k in range(n)]
    kw = dict(pad_token_id=0, eos_token_id=None, max_batch_size=args.batch_size, max_context_len=max_ctx,
              seed=args.seed, device=device)
    merged = TorchEngine(copy.deepcopy(model), name="bench-merged", **kw)
    await merged.update_weights_from_tensors(dict(pays[0]), version=1)  # one LoRA policy: merged into the weights
    slots = TorchEngine(copy.deepcopy(model), name="bench-slots", max_loras=n, max_lora_rank=args.lora_rank, **kw)
    names = [f"p{k}" for k in range(n)]
    for name, pay in zip(names, pays):
        await slots.update_weights_from_tensors(dict(pay), version=1, policy=name)
    cases = {"one_merged": (merged, [None]), "many": (slots, names), "one_unmerged": (slots, names[:1])}
    runs: dict[str, list[float]] = {k: [] for k in cases}
    try:
        for engine, pol in cases.values():  # warm-up
            await run_policies(engine, prompts[:8], [4] * 8, pol, args.temperature)
        for k in range(args.lora_rounds):
            order = list(cases) if k % 2 == 0 else list(reversed(cases))
            for case in order:
                engine, pol = cases[case]
                dt, tok = await run_policies(engine, prompts, lengths, pol, args.temperature)
                runs[case].append(tok / dt)
    finally:
        await merged.close()
        await slots.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"adapters": n, "rank": args.lora_rank, "rounds": args.lora_rounds, "tokens_per_s": runs,
            "tokens_per_s_median": med, "ratio_many_vs_one_merged": med["many"] / med["one_merged"],
            "ratio_one_unmerged_vs_one_merged": med["one_unmerged"] / med["one_merged"]}


# ----------------------------------------------------------------------------------------------- main

def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32, help="static batch size = continuous max_batch_size")
    ap.add_argument("--min-len", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--alpha", type=float, default=1.2, help="Pareto tail index of the output lengths")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[8, 32])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=82)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--updates", type=int, default=5, help="weight updates per model in the pause measurement")
    ap.add_argument("--qwen", choices=["0.5b", "none"], default="0.5b",
                    help="also measure the update pause of a Qwen2-0.5B-shaped random model")
    ap.add_argument("--skip-engine-static", action="store_true", help="skip the engine-on-static-batches line")
    ap.add_argument("--chat-groups", type=int, default=16, help="prefix cache part: prompt groups per round")
    ap.add_argument("--chat-group-size", type=int, default=8, help="chains per group (sharing its prompt)")
    ap.add_argument("--chat-turns", type=int, default=3)
    ap.add_argument("--chat-prompt-len", type=int, default=8, help="the default run's a+b prompt: 8 tokens")
    ap.add_argument("--chat-feedback-len", type=int, default=19, help="tokens of the feedback turn between answers "
                                                                      "(the default agent's: 19)")
    ap.add_argument("--chat-max-new", type=int, default=3, help="tokens per answer (a+b: 2 digits and eos)")
    ap.add_argument("--chat-batch-size", type=int, default=256, help="max_batch_size (the run's default)")
    ap.add_argument("--chat-rounds", type=int, default=4, help="rounds per engine, alternating on/off")
    ap.add_argument("--chat-cache-tokens", type=int, default=32768, help="the cache's token budget")
    ap.add_argument("--loras", type=int, default=4, help="multi-LoRA part: adapters in one batch (0: skip)")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-rounds", type=int, default=3, help="rounds per case, alternating")
    ap.add_argument("--json", default="", help="also write the results to this JSON file")
    return ap.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = long_tailed_lengths(args.num_requests, args.min_len, args.max_len, args.alpha, args.seed)
    prompts = make_prompts(args.num_requests, args.vocab, args.prompt_len[0], args.prompt_len[1], args.seed)
    max_ctx = args.prompt_len[1] + args.max_len + 1
    model = tiny_model(args.vocab, args.hidden, args.layers, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    res: dict[str, Any] = {
        "workload": {"requests": args.num_requests, "batch_size": args.batch_size,
                     "len_min": min(lengths), "len_median": float(np.median(lengths)),
                     "len_mean": float(np.mean(lengths)), "len_p90": float(np.percentile(lengths, 90)),
                     "len_max": max(lengths), "alpha": args.alpha, "tokens": sum(lengths),
                     "model_params": n_params, "threads": args.threads},
    }
    print(f"workload: {args.num_requests} requests, output lengths {min(lengths)}..{max(lengths)} "
          f"(median {np.median(lengths):.0f}, mean {np.mean(lengths):.1f}, p90 {np.percentile(lengths, 90):.0f}), "
          f"batch {args.batch_size}, model {n_params / 1e6:.2f}M params, {args.threads} torch thread(s)", flush=True)

    # warm-up of both paths (first-call allocations, lazy imports)
    warm_p, warm_l = prompts[:4], [4] * 4
    run_hf_static(model, warm_p, warm_l, 4, args.temperature, 0)
    engine = TorchEngine(model, pad_token_id=0, eos_token_id=None, max_batch_size=args.batch_size,
                         max_context_len=max_ctx, seed=args.seed, name="bench")

    async def engine_part() -> dict[str, Any]:
        out: dict[str, Any] = {}
        await run_continuous(engine, warm_p, warm_l, args.temperature)
        dt, tok = await run_continuous(engine, prompts, lengths, args.temperature)
        out["continuous"] = {"seconds": dt, "tokens": tok, "tokens_per_s": tok / dt,
                             "decode_forwards": engine.stats()["decode_forwards"]}
        if not args.skip_engine_static:
            dt, tok = await run_engine_static(engine, prompts, lengths, args.batch_size, args.temperature)
            out["engine_static"] = {"seconds": dt, "tokens": tok, "tokens_per_s": tok / dt}
        return out

    res.update(asyncio.run(engine_part()))
    dt, tok = run_hf_static(model, prompts, lengths, args.batch_size, args.temperature, 0)
    res["hf_static"] = {"seconds": dt, "tokens": tok, "tokens_per_s": tok / dt}
    res["ratio_continuous_vs_hf_static"] = res["continuous"]["tokens_per_s"] / res["hf_static"]["tokens_per_s"]
    print(f"continuous batching (TorchEngine):   {res['continuous']['tokens_per_s']:9.1f} tok/s "
          f"({res['continuous']['seconds']:.2f} s)")
    if "engine_static" in res:
        res["ratio_continuous_vs_engine_static"] = (res["continuous"]["tokens_per_s"]
                                                    / res["engine_static"]["tokens_per_s"])
        print(f"static batches (TorchEngine):        {res['engine_static']['tokens_per_s']:9.1f} tok/s "
              f"({res['engine_static']['seconds']:.2f} s)")
    print(f"static batches (HF generate):        {res['hf_static']['tokens_per_s']:9.1f} tok/s "
          f"({res['hf_static']['seconds']:.2f} s)")
    print(f"RATIO continuous / HF static: {res['ratio_continuous_vs_hf_static']:.2f}x"
          + (f"   (continuous / engine static: {res['ratio_continuous_vs_engine_static']:.2f}x)"
             if "engine_static" in res else ""), flush=True)

    if args.chat_rounds > 0:
        pc = res["prefix_cache"] = asyncio.run(measure_prefix_cache(model, args))
        print(f"prefix cache, multi-turn chats ({pc['shape']['groups']}x{pc['shape']['group_size']} chains, "
              f"{pc['shape']['turns']} turns, {pc['rounds']} rounds each, alternating): CPU per turn "
              f"on {pc['on']['cpu_ms_per_turn_median']:.2f} ms, off {pc['off']['cpu_ms_per_turn_median']:.2f} ms "
              f"= {pc['cpu_ratio_off_vs_on']:.2f}x; prefill tokens per turn "
              f"on {pc['on']['prefill_tokens_per_turn']:.1f}, off {pc['off']['prefill_tokens_per_turn']:.1f}",
              flush=True)
        lf = res["lean_forward"] = asyncio.run(measure_lean_forward(model, args))
        print(f"lean forward, the same chats (prefix cache on, {lf['rounds']} rounds each, alternating): CPU per turn "
              f"lean {lf['lean']['cpu_ms_per_turn_median']:.2f} ms, "
              f"HF forward {lf['hf']['cpu_ms_per_turn_median']:.2f} ms = {lf['cpu_ratio_hf_vs_lean']:.2f}x", flush=True)

    if args.loras > 0:
        ml = res["multi_lora"] = asyncio.run(measure_multi_lora(model, prompts, lengths, args, max_ctx))
        med = ml["tokens_per_s_median"]
        print(f"multi-lora: {ml['adapters']} adapters in one batch at {100 * ml['ratio_many_vs_one_merged']:.0f}% of "
              f"one adapter's tokens/s ({med['many']:.1f} vs {med['one_merged']:.1f} tok/s merged, rank "
              f"{ml['rank']}, {ml['rounds']} rounds each); one adapter unmerged: "
              f"{100 * ml['ratio_one_unmerged_vs_one_merged']:.0f}%", flush=True)

    with tempfile.TemporaryDirectory(prefix="arl-bench-") as tmp:
        paths = [os.path.join(tmp, f"tiny{k}.safetensors") for k in range(2)]
        for k, p in enumerate(paths):
            save_weights(model, p, scale=1.0 + 0.01 * k)

        async def tiny_pause() -> dict[str, Any]:
            return await measure_update_pause(engine, paths, prompts[:args.batch_size], min(64, args.max_len),
                                              args.updates)

        res["update_tiny"] = asyncio.run(tiny_pause())
        asyncio.run(engine.close())
        u = res["update_tiny"]
        print(f"weight update, tiny model ({n_params / 1e6:.2f}M params): pause median {u['pause_ms_median']:.2f} ms, "
              f"max {u['pause_ms_max']:.2f} ms; caller latency median {u['caller_ms_median']:.2f} ms "
              f"({u['updates']} updates, {u['rows_in_flight_at_update'][0]} rows in flight, "
              f"{u['requests_lost_or_cut']} requests lost)", flush=True)

        if args.qwen == "0.5b":
            t0 = time.perf_counter()
            big = qwen2_05b_model()
            qpath = os.path.join(tmp, "qwen.safetensors")
            save_weights(big, qpath)
            big_params = sum(p.numel() for p in big.parameters())
            build_s = time.perf_counter() - t0
            beng = TorchEngine(big, pad_token_id=0, eos_token_id=None, max_batch_size=4, max_context_len=64,
                               seed=args.seed, name="bench-qwen")

            async def qwen_pause() -> dict[str, Any]:
                qp = make_prompts(2, 1000, 8, 8, args.seed)
                return await measure_update_pause(beng, [qpath], qp, 48, args.updates, settle_steps=1)

            res["update_qwen2_0.5b"] = {"params": big_params, "dtype": "bfloat16",
                                        "file_bytes": os.path.getsize(qpath), "build_s": build_s,
                                        **asyncio.run(qwen_pause())}
            asyncio.run(beng.close())
            u = res["update_qwen2_0.5b"]
            print(f"weight update, Qwen2-0.5B-shaped ({big_params / 1e6:.0f}M params, bf16, "
                  f"{u['file_bytes'] / 2**20:.0f} MiB file): pause median {u['pause_ms_median']:.1f} ms, "
                  f"max {u['pause_ms_max']:.1f} ms; caller latency median {u['caller_ms_median']:.1f} ms "
                  f"({u['updates']} updates, {u['requests_lost_or_cut']} requests lost)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
