"""One GPU, one command: the production path on one device, each part printing `FIGURE` lines that the end sums up.

    bash scripts/gpu_check.sh [--device cuda|cpu]       # what to run: installs the carried wheels on a GPU machine
    python scripts/gpu_check.py --device cpu             # every part, each in its own process, then the summary
    python scripts/gpu_check.py --device cpu --part b    # one part, in this process

Parts (sizes in SIZES: a GPU run fits 10 minutes on one H100; `--device cpu` is the dry run of the same code with
small sizes, the tiny model in place of the 0.5B one):

a. the default experiment (`training/main_async_ppo.py`) with inference and the learner on the device, both in
   bf16 (`inference.dtype`, `learner.deepspeed.bf16`, ZeRO-2), weights by disk: the held-out accuracy curve;
b. a Qwen2.5-0.5B-shaped model (random weights, made on the spot) in the torch engine: tokens/s of continuous
   batching on the long-tailed workload vs HF `generate` on static batches, and the in-flight weight-update pause
   (`scripts/bench_engine.py`'s pieces);
c. the DeepSpeed learner (bf16, ZeRO-2) on that model: tokens/s and MFU of one PPO step (`PPOActor.step`: one
   no-grad forward for the proximal logprobs, then forward + backward of every token over the minibatches);
d. the learner and the engine on one device in one process, weights by disk: each version the learner's step
   (while the engine decodes beside it), its export and the engine's load;
e. several LoRA policies in one batch on that model (`TorchEngine(max_loras=4)`, `arl/inference/multi_lora.py`):
   the long-tailed workload spread over 4 rank-16 adapters vs one adapter merged into the weights;
f. where the default run's learner step goes on the device: the step alone (`PPOActor.step`, the same shapes
   each step, in the main thread), then in the learner's own loop (`LearnerWorker.train`: new shapes each step,
   phases in worker threads, weights exported to disk) with cuDNN attention off as the engines now set it, in that
   loop beside an engine decoding the tiny model in another process (as in part a), and on CUDA with cuDNN
   attention on again. The first GPU check (2026-11-30) found part a's learner step at ~9 s where the step alone
   took 0.16 s (`arl/utils/attention.py`).

A part that fails or overruns its time is reported as such in the summary; the others still run. Exit status: 0
when every part passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "scripts")):
    if p not in sys.path:
        sys.path.insert(0, p)

PARTS = "fabcde"  # f first: the diagnosis of part a's slow learner, in case a runs out of time
FIGURE = "FIGURE "
# Qwen2-0.5B's shape, which Qwen2.5-0.5B shares (scripts/bench_engine.py), and a tiny one of the same family.
TINY_QWEN2 = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, use_sliding_window=False)
SIZES: dict[str, dict[str, Any]] = {
    "cuda": dict(shape="0.5b", steps=100, eval_every=25, eval_prompts=200, requests=256, batch=64, max_len=512,
                 prompt_len=(16, 64), updates=3, seqs=128, seq_prompt=(32, 128), gen_median=256.0, seq_max=2048,
                 mb_tokens=8192, learner_steps=2, in_flight=16, overrides=[], e_requests=128, e_max_len=256,
                 e_rounds=1, f_steps=4,
                 timeout_s={"f": 100, "a": 150, "b": 130, "c": 60, "d": 90, "e": 90}, budget_s=560),
    "cpu": dict(shape="tiny", steps=4, eval_every=2, eval_prompts=20, requests=16, batch=8, max_len=32,
                prompt_len=(4, 12), updates=2, seqs=8, seq_prompt=(4, 8), gen_median=8.0, seq_max=64,
                mb_tokens=256, learner_steps=1, in_flight=4, overrides=["learner.batch_size=4"], e_requests=16,
                e_max_len=32, e_rounds=1, f_steps=2,
                timeout_s={"f": 300, "a": 600, "b": 300, "c": 300, "d": 300, "e": 300}, budget_s=1800),  # CI cores
}
# Dense bf16 peak of one GPU (TFLOP/s), by a part of its name, first match wins; MFU is n/a for others.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4), ("A100", 312.0))


# ------------------------------------------------------------------------------------------------ arithmetic

def forward_flops(linear_params: int, layers: int, hidden: int, seq_lens: Sequence[int], causal: bool = True) -> float:
    """FLOPs of one forward pass over sequences of `seq_lens`: 2 per weight of every linear layer (lm_head included,
    tied or not) per token, plus attention's two products (Q K^T and scores x V), 2 * 2 * hidden * L^2 per layer
    and sequence, of which a causal kernel needs half."""
    tokens = sum(seq_lens)
    attention = (2 if causal else 4) * layers * hidden * sum(n * n for n in seq_lens)
    return 2.0 * linear_params * tokens + attention


def ppo_step_flops(linear_params: int, layers: int, hidden: int, seq_lens: Sequence[int]) -> float:
    """One `PPOActor.step`: a no-grad forward (proximal logprobs) + forward and backward (2x) of every token."""
    return 4.0 * forward_flops(linear_params, layers, hidden, seq_lens)


def peak_tflops(device_name: str) -> Optional[float]:
    return next((v for k, v in PEAK_BF16_TFLOPS if k in device_name), None)


def linear_params(model: Any) -> int:
    import torch

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


# ------------------------------------------------------------------------------------------------ summary

def figures(text: str) -> list[str]:
    """The figure lines a part printed (`FIGURE <line>`), in order."""
    return [line[len(FIGURE):].rstrip() for line in text.splitlines() if line.startswith(FIGURE)]


def summary(results: list[dict[str, Any]], header: str) -> list[str]:
    """The closing block: one line per part (status, seconds), then its figures."""
    ok = sum(1 for r in results if r["rc"] == 0)
    out = [f"==== GPU check summary: {header} ===="]
    for r in results:
        status = "ok" if r["rc"] == 0 else ("TIMED OUT" if r.get("timed_out") else f"FAILED (exit {r['rc']})")
        out.append(f"[{r['part']}] {status}, {r['seconds']:.0f} s")
        out += [f"    {f}" for f in r["figures"]] or ["    (no figure)"]
    out.append(f"==== GPU check: {ok}/{len(results)} parts passed ====")
    return out


def say(line: str) -> None:
    print(FIGURE + line, flush=True)


# ------------------------------------------------------------------------------------------------ parts

def part_a(dev: str, sz: dict[str, Any], out_dir: str) -> None:
    """The default experiment through the real launcher: every role its own process, one device. While it runs:
    once three steps are in and the learner's step is slow (> 2 s: the tiny model's step takes a fraction of that),
    three samples of the learner's Python stacks; stopped at its time limit, it still reports what it saw."""
    import re

    from arl.utils.forensics import request_stack_dump

    run_dir = os.path.join(ROOT, "runs")
    name = f"gpu-check-a-{dev}-{os.getpid()}"
    cmd = [sys.executable, os.path.join(ROOT, "training", "main_async_ppo.py"), f"run_dir={run_dir}",
           f"run_name={name}", f"total_train_steps={sz['steps']}", f"eval.every_n_steps={sz['eval_every']}",
           f"eval.max_prompts={sz['eval_prompts']}", "progress=false", f"inference.device={dev}",
           "inference.dtype=bfloat16", f"learner.device={dev}", "learner.deepspeed.bf16=true",
           "learner.deepspeed.zero_stage=2", "weights.transport=disk", *sz["overrides"]]
    print(" ".join(cmd[1:]), flush=True)
    path = os.path.join(run_dir, name, "metrics.jsonl")
    learner_log = os.path.join(run_dir, name, "logs", "learner.log")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    recs: list[dict[str, Any]] = []
    sampled = False

    def read() -> list[dict[str, Any]]:
        return [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []

    def report(done: bool) -> None:
        train = [r for r in recs if r.get("type") == "train"]
        if not train:
            return
        step_s = statistics.median(r["learner_step_seconds"] for r in train[1:] or train)
        phases = [r["learner_phase_seconds"] for r in train[1:] or train if r.get("learner_phase_seconds")]
        ph = ", ".join(f"{k} {statistics.median(p.get(k, 0.0) for p in phases):.3f}" for k in phases[-1]) if phases else ""
        rss = [r.get("rss_mib", {}).get("learner0") for r in train]
        say(f"a. {'' if done else 'stopped at its time limit: '}{len(train)} steps in {time.monotonic() - t0:.0f} s; "
            f"learner step median {step_s:.3f} s (phases, median s: {ph}); learner RSS {rss[0]} -> {rss[-1]} MiB")

    try:
        while proc.poll() is None:
            time.sleep(2.0)
            recs = read()
            train = [r for r in recs if r.get("type") == "train"]
            if not sampled and len(train) >= 3 and statistics.median(
                    r["learner_step_seconds"] for r in train[-3:]) > 2.0 and os.path.exists(learner_log):
                sampled = True
                m = re.search(r"starting learner0 \(pid (\d+)", open(learner_log).read())
                for i in range(3 if m else 0):
                    _, dump = request_stack_dump(int(m.group(1)), learner_log)
                    print(f"---- learner stacks, sample {i + 1} of 3 (a slow step) ----\n{dump}", flush=True)
                    time.sleep(1.0)
        rc = proc.returncode
        wall = time.monotonic() - t0
        recs = read()
    finally:
        if proc.poll() is None:  # this part's time is up (SIGTERM): say what it saw, then stop the run
            recs = read()
            report(done=False)
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        if out_dir and recs:
            with open(os.path.join(out_dir, "gpu-check-a-metrics.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in recs)
    evals = [r for r in recs if r.get("type") == "eval"]
    train = [r for r in recs if r.get("type") == "train"]
    if rc != 0 or not evals:
        raise SystemExit(f"the default run failed (exit {rc}, {len(evals)} evaluations); see {run_dir}/{name}")
    report(done=True)
    curve = " ".join(f"{r['step']}:{r['first_acc']:.3f}" for r in evals)
    upd = evals[-1].get("roles", {}).get("inference0", {}).get("update_ms_last", float("nan"))
    say(f"a. default run on {dev} (bf16 inference + bf16 ZeRO-2 learner, weights by disk), {len(train)} steps: "
        f"held-out accuracy {evals[0]['first_acc']:.3f} -> {evals[-1]['first_acc']:.3f}, {wall:.0f} s for the "
        f"command, last weight load {upd:.0f} ms")
    say(f"a. held-out accuracy curve (step:greedy first-answer accuracy): {curve}")


def _shape(sz: dict[str, Any]) -> dict[str, Any]:
    from bench_engine import QWEN2_05B_SHAPE

    return QWEN2_05B_SHAPE if sz["shape"] == "0.5b" else TINY_QWEN2


def _label(sz: dict[str, Any], model: Any) -> str:
    n = sum(p.numel() for p in model.parameters())
    return f"{'Qwen2.5-0.5B' if sz['shape'] == '0.5b' else 'tiny Qwen2'}-shaped ({n / 1e6:.1f}M params)"


def part_b(dev: str, sz: dict[str, Any], out_dir: str) -> None:
    import tempfile

    import numpy as np
    import torch

    from arl.inference.torch_engine import TorchEngine
    from bench_engine import (long_tailed_lengths, make_prompts, measure_update_pause, qwen2_05b_model,
                              run_continuous, run_hf_static, save_weights)

    shape = _shape(sz)
    model = qwen2_05b_model(shape, device=dev, dtype=torch.bfloat16)
    label = _label(sz, model)
    lengths = long_tailed_lengths(sz["requests"], 4, sz["max_len"], 1.2, seed=0)
    prompts = make_prompts(sz["requests"], shape["vocab_size"], *sz["prompt_len"], seed=0)
    print(f"{label}, bf16 on {dev}; {len(lengths)} requests, output lengths {min(lengths)}..{max(lengths)} (median "
          f"{np.median(lengths):.0f}, {sum(lengths)} tokens), batch {sz['batch']}", flush=True)
    run_hf_static(model, prompts[:4], [4] * 4, 4, 1.0, 0)  # warm-up: first kernels, allocator
    engine = TorchEngine(model, pad_token_id=0, eos_token_id=None, max_batch_size=sz["batch"],
                         max_context_len=sz["prompt_len"][1] + sz["max_len"] + 1, device=dev, name="gpu-check")

    async def generate() -> tuple[float, int]:
        await run_continuous(engine, prompts[:4], [4] * 4, 1.0)
        return await run_continuous(engine, prompts, lengths, 1.0)

    dt_e, tok = asyncio.run(generate())
    dt_h, _ = run_hf_static(model, prompts, lengths, sz["batch"], 1.0, 0)
    say(f"b. generation, {label} bf16 on {dev}, {len(lengths)} long-tailed requests ({tok} tokens), batch "
        f"{sz['batch']}: torch engine {tok / dt_e:.0f} tok/s vs HF generate (static batches) {tok / dt_h:.0f} tok/s "
        f"= {dt_h / dt_e:.2f}x")
    with tempfile.TemporaryDirectory(prefix="arl-gpu-check-") as tmp:
        path = os.path.join(tmp, "w.safetensors")
        save_weights(model, path, scale=1.0)

        async def pause() -> dict[str, Any]:
            try:
                max_new = 64 if dev == "cuda" else 16
                return await measure_update_pause(engine, [path], prompts[:sz["in_flight"]], max_new, sz["updates"],
                                                  settle_steps=2)
            finally:
                await engine.close()

        u = asyncio.run(pause())
        mib = os.path.getsize(path) / 2**20
    say(f"b. in-flight weight update from disk ({mib:.1f} MiB safetensors, {u['updates']} updates, "
        f"{u['rows_in_flight_at_update'][0]} rows in flight): decode pause median {u['pause_ms_median']:.1f} ms, max "
        f"{u['pause_ms_max']:.1f} ms; update_weights latency median {u['caller_ms_median']:.0f} ms; "
        f"{u['requests_lost_or_cut']} requests lost")


def part_e(dev: str, sz: dict[str, Any], out_dir: str) -> None:
    import types

    import torch

    from bench_engine import long_tailed_lengths, make_prompts, measure_multi_lora, qwen2_05b_model

    shape = _shape(sz)
    model = qwen2_05b_model(shape, device=dev, dtype=torch.bfloat16)
    label = _label(sz, model)
    # fewer and shorter requests than part b's: 3 passes (4 adapters, one merged, one unmerged) of a launch-bound
    # engine (part b: ~65 ms a decode step on the first H200 lent) must fit the part's time
    lengths = long_tailed_lengths(sz["e_requests"], 4, sz["e_max_len"], 1.2, seed=0)
    prompts = make_prompts(sz["e_requests"], shape["vocab_size"], *sz["prompt_len"], seed=0)
    args = types.SimpleNamespace(loras=4, lora_rank=16, lora_rounds=sz["e_rounds"], batch_size=sz["batch"], seed=0,
                                 temperature=1.0)
    ml = asyncio.run(measure_multi_lora(model, prompts, lengths, args, sz["prompt_len"][1] + sz["e_max_len"] + 1,
                                        device=dev))
    med = ml["tokens_per_s_median"]
    say(f"e. multi-lora, {label} bf16 on {dev}, {len(lengths)} long-tailed requests, batch {sz['batch']}: "
        f"{ml['adapters']} rank-{ml['rank']} adapters in one batch at {100 * ml['ratio_many_vs_one_merged']:.0f}% of "
        f"one adapter's tokens/s ({med['many']:.0f} vs {med['one_merged']:.0f} tok/s merged); one adapter unmerged "
        f"{100 * ml['ratio_one_unmerged_vs_one_merged']:.0f}%")


def _learner(dev: str, sz: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """The DeepSpeed learner (bf16, ZeRO-2) on the part's model, its actor, a long-tailed batch, and the model."""
    import torch

    from arl.config import DeepSpeedConfig, OptimizerConfig, PPOConfig
    from arl.learner.actor import PPOActor
    from arl.learner.deepspeed_engine import DeepSpeedEngine
    from bench_engine import qwen2_05b_model
    from bench_learner import long_tailed_batch

    shape = _shape(sz)
    model = qwen2_05b_model(shape, device=dev, dtype=torch.float32)  # DeepSpeed casts; fp32 master weights
    engine = DeepSpeedEngine(model, OptimizerConfig(lr=1e-6),
                             DeepSpeedConfig(zero_stage=2, bf16=True, max_tokens_per_mb=sz["mb_tokens"]), device=dev)
    batch = long_tailed_batch(sz["seqs"], shape["vocab_size"], sz["seq_prompt"], sz["gen_median"], 1.0,
                              sz["seq_max"], groups=max(1, sz["seqs"] // 8))
    return engine, PPOActor(engine, PPOConfig()), batch, model


def part_c(dev: str, sz: dict[str, Any], out_dir: str) -> None:
    import torch

    from bench_engine import sync

    engine, actor, batch, model = _learner(dev, sz)
    label = _label(sz, model)
    lens = [len(t.input_ids) for t in batch]
    actor.step(batch)  # warm-up
    times = []
    for _ in range(sz["learner_steps"]):
        sync(engine.device)
        t0 = time.perf_counter()
        actor.step(batch)
        sync(engine.device)
        times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    cfg = model.config
    flops = ppo_step_flops(linear_params(model), cfg.num_hidden_layers, cfg.hidden_size, lens)
    name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    peak = peak_tflops(name)
    mfu = f"MFU {flops / s / (peak * 1e12):.1%} of {peak:.0f} TFLOP/s" if peak else f"MFU n/a (no bf16 peak for {name})"
    mem = (f", peak memory {torch.cuda.max_memory_allocated(engine.device) / 2**30:.1f} GiB"
           if engine.device.type == "cuda" else "")
    say(f"c. learner PPO step, {label}, bf16 DeepSpeed ZeRO-2 on {engine.device}, {len(lens)} sequences "
        f"({sum(lens)} tokens, lengths {min(lens)}..{max(lens)}): {s:.3f} s = {sum(lens) / s:.0f} tokens/s, "
        f"{flops / s / 1e12:.3g} TFLOP/s, {mfu}{mem}")


def part_d(dev: str, sz: dict[str, Any], out_dir: str) -> None:
    import tempfile

    import numpy as np
    import torch

    from arl.api.types import GenerateRequest, GenerationConfig
    from arl.inference.torch_engine import TorchEngine
    from bench_engine import qwen2_05b_model

    learner, actor, batch, _ = _learner(dev, sz)
    shape = _shape(sz)
    model = qwen2_05b_model(shape, device=dev, dtype=torch.bfloat16)
    label = _label(sz, model)
    engine = TorchEngine(model, pad_token_id=0, eos_token_id=None, max_batch_size=sz["in_flight"],
                         max_context_len=sz["prompt_len"][1] + sz["max_len"] + 1, device=dev, name="gpu-check-d")
    rng = np.random.default_rng(0)

    async def go() -> list[dict[str, float]]:
        async def keep_generating(k: int) -> None:
            while True:
                ids = rng.integers(5, shape["vocab_size"], size=sz["prompt_len"][0]).astype(np.int32)
                await engine.agenerate(GenerateRequest(f"d{k}", ids, GenerationConfig(max_new_tokens=sz["max_len"])))

        gen = [asyncio.create_task(keep_generating(k)) for k in range(sz["in_flight"])]
        rows: list[dict[str, float]] = []
        try:
            with tempfile.TemporaryDirectory(prefix="arl-gpu-check-") as tmp:
                for v in range(1, sz["updates"] + 1):
                    tok0, t0 = engine.stats()["tokens_generated"], time.perf_counter()
                    await asyncio.to_thread(actor.step, batch)
                    t1 = time.perf_counter()
                    tok1 = engine.stats()["tokens_generated"]
                    path = os.path.join(tmp, f"v{v}.safetensors")
                    await asyncio.to_thread(learner.export_weights, path)
                    t2 = time.perf_counter()
                    await engine.update_weights(path, v)
                    t3 = time.perf_counter()
                    rows.append({"step_s": t1 - t0, "gen_tok_s": (tok1 - tok0) / (t1 - t0), "export_s": t2 - t1,
                                 "load_s": t3 - t2, "pause_ms": engine.stats()["last_update_s"] * 1e3,
                                 "mib": os.path.getsize(path) / 2**20})
                    os.unlink(path)
        finally:
            for t in gen:
                t.cancel()
            await asyncio.gather(*gen, return_exceptions=True)
            await engine.close()
        return rows

    rows = asyncio.run(go())
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    mem = (f"; peak memory {torch.cuda.max_memory_allocated(learner.device) / 2**30:.1f} GiB for both"
           if learner.device.type == "cuda" else "")
    say(f"d. learner + engine on one {dev} (one process, weights by disk), {label}, {len(rows)} versions: learner "
        f"step {med['step_s']:.2f} s while the engine decoded {med['gen_tok_s']:.0f} tok/s beside it; export "
        f"{med['export_s']:.2f} s ({med['mib']:.1f} MiB), engine load {med['load_s']:.2f} s, decode pause "
        f"{med['pause_ms']:.1f} ms (medians){mem}")


def _default_cfg(dev: str) -> Any:
    """The default experiment's config on `dev` as part a runs it, with its warm tiny model's folder."""
    from arl.cli import load_config
    from arl.launch.run import prepare_model
    from experiments import MODULES

    over = [f"learner.device={dev}", f"inference.device={dev}"]
    if dev == "cuda":
        over += ["learner.deepspeed.bf16=true", "learner.deepspeed.zero_stage=2", "inference.dtype=bfloat16"]
    cfg = load_config(over, MODULES)
    cfg.model.path = prepare_model(cfg)
    return cfg


def default_like_groups(n_groups: int, group_size: int, version: int, tag: str, seed: int = 0) -> list[list[Any]]:
    """Groups shaped like the default run's: a 7-token prompt shared by the group, then 1-3 turns of a 2-4 token
    answer (the loss tokens, generated at `version`) and 19 tokens of feedback."""
    import numpy as np

    from arl.api.types import Trajectory

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(3, 40, size=7)
        group = []
        for _ in range(group_size):
            ids, mask = [prompt], [np.zeros(7)]
            for _ in range(int(rng.integers(1, 4))):
                answer = rng.integers(3, 40, size=int(rng.integers(2, 5)))
                ids += [answer, rng.integers(3, 40, size=19)]
                mask += [np.ones(len(answer)), np.zeros(19)]
            m = np.concatenate(mask)
            group.append(Trajectory(np.concatenate(ids).astype(np.int64), m, np.where(m > 0, -2.0, 0.0),
                                    np.where(m > 0, version, -1), float(rng.integers(0, 2)), f"{tag}{g}"))
        groups.append(group)
    return groups


async def _worker_steps(actor: Any, steps: int, weights_dir: str, tag: str) -> list[dict[str, Any]]:
    """`steps` steps of the learner's own loop (`LearnerWorker.train`) on a buffer of default-like groups; the
    step records it published."""
    from arl.learner.worker import LearnerWorker

    sent: list[dict[str, Any]] = []

    async def send(msg: Any) -> None:
        metrics = getattr(msg, "metrics", None)
        if isinstance(metrics, dict):
            sent.append(metrics)

    v0 = actor.engine.version
    worker = LearnerWorker(actor=actor, pull=None, send_control=send, batch_size=16, total_steps=v0 + steps,
                           weights_dir=weights_dir, staleness=actor.staleness)
    for j in range(steps):
        worker.buffer.extend(default_like_groups(16, 8, v0 + j, f"{tag}{j}-", seed=j))
    await asyncio.wait_for(worker.train(), 600)
    return sent


def part_f(dev: str, sz: dict[str, Any], out_dir: str) -> None:
    import tempfile

    import psutil
    import torch

    from arl.learner.entry import learner_actor

    cfg = _default_cfg(dev)
    actor = learner_actor(cfg)[0]  # its engine turned cuDNN attention off (arl/utils/attention.py)
    me = psutil.Process()
    steps = sz["f_steps"]
    what = f"the default run's learner step on {dev} ({'bf16 ZeRO-2' if dev == 'cuda' else 'fp32 ZeRO-0'})"
    batch = [t for g in default_like_groups(16, 8, actor.engine.version, "alone") for t in g]
    actor.step(batch)  # warm-up
    times = []
    for _ in range(steps):
        batch = [t for g in default_like_groups(16, 8, actor.engine.version, "alone") for t in g]  # same shapes
        t0 = time.perf_counter()
        actor.step(batch)
        times.append(time.perf_counter() - t0)
    say(f"f. {what}, 16 groups x 8 ({sum(len(t.input_ids) for t in batch)} tokens), the same shapes every step, in "
        f"the main thread: {statistics.median(times):.3f} s")

    def loop(label: str, tmp: str) -> None:
        rss0 = me.memory_info().rss
        recs = asyncio.run(_worker_steps(actor, steps, tmp, label.split()[0]))
        step = statistics.median(r["learner_step_seconds"] for r in recs)
        ph = ", ".join(f"{k} {v:.3f}" for k, v in recs[-1].get("learner_phase_seconds", {}).items())
        say(f"f. {what} in its worker loop (new shapes each step, phases in worker threads), {label}: {step:.3f} s "
            f"(last step's phases: {ph}); process RSS {rss0 / 2**20:.0f} -> {me.memory_info().rss / 2**20:.0f} MiB "
            f"over {steps} steps")

    with tempfile.TemporaryDirectory(prefix="arl-gpu-check-f-") as tmp:
        loop("cuDNN attention off (as the engines set it)", tmp)
        decoder = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--device", dev, "--decode-loop",
                                    cfg.model.path, "--decode-seconds", "300"], cwd=ROOT, stdout=subprocess.PIPE,
                                   text=True, start_new_session=True)
        try:
            assert decoder.stdout is not None
            ready = decoder.stdout.readline()  # "decoding": its engine is up and busy
            if "decoding" not in ready:
                raise SystemExit(f"the decoding process did not start (said {ready!r})")
            loop("beside an engine decoding in another process", tmp)
        finally:
            decoder.kill()
            decoder.wait()
        if dev == "cuda":  # the behaviour before 2026-11-30, last: it may take the rest of the part's time
            torch.backends.cuda.enable_cudnn_sdp(True)
            loop("cuDNN attention on (torch's default)", tmp)


def decode_loop(dev: str, model_path: str, seconds: float) -> None:
    """Part f's neighbour: the default run's engine on `dev` decoding the tiny model without pause (16 requests
    of 8 samples, 8 tokens each, again and again) for `seconds`; prints 'decoding' once it is busy."""
    from arl.api.types import GenerateRequest, GenerationConfig
    from arl.inference.factory import BACKENDS

    cfg = _default_cfg(dev)
    engine = BACKENDS.get("torch")(model_path, cfg.inference, seed=0, index=0, run_dir="")
    end = time.monotonic() + seconds

    async def go() -> None:
        import numpy as np

        rng = np.random.default_rng(0)

        async def one(i: int) -> None:
            ids = rng.integers(3, 40, size=30).astype(np.int32)
            await engine.agenerate(GenerateRequest(f"q{i}", ids, GenerationConfig(n=8, max_new_tokens=8)))

        first = True
        while time.monotonic() < end:
            await asyncio.gather(*(one(i) for i in range(16)))
            if first:
                print("decoding", flush=True)
                first = False
        await engine.close()

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ driver

def run_part(part: str, dev: str, timeout_s: float, out_dir: str, script: str = __file__) -> dict[str, Any]:
    """Run one part in a child process (its own session, so a timeout ends it and whatever it started), echoing
    its output, and collect its figures."""
    cmd = [sys.executable, os.path.abspath(script), "--device", dev, "--part", part, "--out-dir", out_dir]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        rc = proc.returncode if proc.returncode is not None else -9
    reader.join(timeout=10)
    return {"part": part, "rc": rc if not timed_out else (rc or -1), "timed_out": timed_out,
            "seconds": time.monotonic() - t0, "figures": figures("".join(lines))}


def describe(dev: str) -> str:
    import platform

    import torch

    where = torch.cuda.get_device_name(0) if dev == "cuda" and torch.cuda.is_available() else platform.machine()
    return (f"device {dev} ({where}), torch {torch.__version__}, Python {platform.python_version()}, "
            f"{os.cpu_count()} cores")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--part", default="", help="run only these parts in this process (e.g. b or bc)")
    ap.add_argument("--parts", default=PARTS, help="the parts the driver runs, in order")
    ap.add_argument("--budget-s", type=float, default=0.0, help="the whole check's time (default: 480 s on cuda, "
                    "1500 on cpu); a part gets at most its own limit and what is left of this")
    ap.add_argument("--out-dir", default="", help="where part a copies its metrics.jsonl")
    ap.add_argument("--decode-loop", default="", metavar="MODEL_DIR", help=argparse.SUPPRESS)  # part f's neighbour
    ap.add_argument("--decode-seconds", type=float, default=300.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sz = SIZES[a.device]
    if a.decode_loop:
        decode_loop(a.device, a.decode_loop, a.decode_seconds)
        return 0
    if a.part:
        # A part past its time gets SIGTERM: exit through Python, so `finally` blocks run (torch's JIT-build lock in
        # TORCH_EXTENSIONS_DIR, held while DeepSpeed builds an op, would otherwise stay and stall every later build).
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        import torch

        torch.manual_seed(0)
        if a.device == "cpu":
            torch.set_num_threads(1)  # the dry run: several threads on a shared 2-core machine only spin
        elif not torch.cuda.is_available():
            raise SystemExit("--device cuda, but torch sees no CUDA device")
        for p in a.part:
            globals()[f"part_{p}"](a.device, sz, a.out_dir)
        return 0
    header = describe(a.device)
    print(f"GPU check: {header}; parts {a.parts}", flush=True)
    deadline = time.monotonic() + (a.budget_s or sz["budget_s"])
    results = []
    for p in a.parts:
        left = deadline - time.monotonic()
        if left < 20:
            results.append({"part": p, "rc": -1, "timed_out": True, "seconds": 0.0, "figures": ["(no time left)"]})
            continue
        print(f"---- part {p} ----", flush=True)
        results.append(run_part(p, a.device, min(sz["timeout_s"][p], left), a.out_dir))
    print("\n".join(summary(results, header)), flush=True)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
