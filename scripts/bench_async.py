"""Asynchronous vs synchronous RL, side by side: the same workload run twice through the real launcher.

    python scripts/bench_async.py --engine sim                  # 16 and 64 simulated H100 servers (~10 min)
    python scripts/bench_async.py --engine sim --servers 64 --steps 6
    python scripts/bench_async.py --engine torch                # the tiny model on this machine's CPU

Both runs use the same prompts (same seed and prompt stream), group size, batch (B groups per step), number of
steps, agent (the synthetic multi-turn tool agent "sim-agent": long-tailed output lengths, tool calls whose
latency is drawn from a log-normal, 1-4 turns, every draw keyed by prompt/chat/turn so both runs see the same
workload) and environment. Only the staleness bound differs:

* synchronous: eta = 0 (max_head_offpolicyness=0): the gate admits the next batch only after the learner has
  published the previous one, so generation and training alternate (the same code path, the baseline);
* asynchronous: eta = 4: generation runs ahead while the learner trains, and weight updates land between decode
  steps of requests in flight (interruptible: their later tokens carry the new version).

Printed per run: wall time of the training window (gate open -> last step published), trajectories trained on
per second, mean busy fraction of the inference servers over that window, the learner's idle fraction (waiting
for a batch), the per-token staleness histogram of what was trained on (version of the step minus version that
made the token) and groups dropped as too stale; then the async/sync throughput ratio.

`--engine sim` uses the simulated inference backend (decode-time model fitted to published H100 figures for a
7B model, see arl/inference/sim_engine.py) and the simulated learner (7B on 8 H100s, arl/learner/sim_learner.py),
with every simulated duration multiplied by --time-scale so that minutes of cluster time run in seconds; one
inference process hosts 16 simulated servers (see run_inference in arl/inference/entry.py).
`--engine torch` runs the real embedded engine and the DeepSpeed learner on the tiny model, randomly initialised
(the tokens and rewards are synthetic; lengths drawn by the agent, exact min=max new tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import RunRecord, inference_busy, machine, make_config, run_monitored, tokenizer_dir  # noqa: E402

IMPORTS = "imports=[arl.agents.sim_agent,arl.envs.sim_tool]"
ETA_ASYNC = 4


def sim_overrides(a: argparse.Namespace, servers: int, eta: int) -> list[str]:
    T = a.time_scale
    return [
        IMPORTS, "agent.name=sim-agent", "env.name=sim-tool", f"agent.group_size={a.group_size}",
        f"agent.args.prompt_tokens={a.prompt_tokens}", f"agent.args.max_new_tokens={a.max_new_tokens}",
        "agent.args.max_total_tokens=32000", "agent.args.length_mode=engine", f"agent.args.seed={a.seed}",
        f"env.args.latency_median_s={a.tool_latency}", "env.args.latency_sigma=1.0", f"env.args.time_scale={T}",
        "env.args.turns_min=1", f"env.args.turns_max={a.max_turns}", f"env.args.seed={a.seed}",
        "inference.backend=sim", f"inference.num_workers={servers}",
        f"inference.servers_per_process={min(servers, a.servers_per_process)}",
        "inference.max_batch_size=256", "inference.max_context_len=32768", f"inference.sim.time_scale={T}",
        f"inference.sim.len_median={a.len_median}", f"inference.sim.len_sigma={a.len_sigma}",
        "learner.backend=sim", f"learner.sim.time_scale={T}", f"learner.sim.s_per_token={a.learner_s_per_token}",
        "learner.sim.step_base_s=0.5",
        f"rollout.num_workers={a.rollout_workers}", "rollout.trajectory_timeout=3600", "rollout.request_timeout=1200",
    ]


def torch_overrides(a: argparse.Namespace, servers: int, eta: int) -> list[str]:
    return [
        IMPORTS, "agent.name=sim-agent", "env.name=sim-tool", f"agent.group_size={a.group_size}",
        f"agent.args.prompt_tokens={a.prompt_tokens}", f"agent.args.max_new_tokens={a.max_new_tokens}",
        "agent.args.max_total_tokens=240", "agent.args.length_mode=agent", f"agent.args.len_median={a.len_median}",
        f"agent.args.len_sigma={a.len_sigma}", f"agent.args.seed={a.seed}",
        f"env.args.latency_median_s={a.tool_latency}", "env.args.latency_sigma=1.0", "env.args.turns_min=1",
        f"env.args.turns_max={a.max_turns}", "env.args.tool_tokens_median=4", f"env.args.seed={a.seed}",
        "inference.backend=torch", f"inference.num_workers={servers}", "inference.max_context_len=256",
        f"rollout.num_workers={a.rollout_workers}", "rollout.trajectory_timeout=600", "rollout.request_timeout=300",
    ]


def tiny_model_dir(root: str) -> str:
    """The tiny char Llama, randomly initialised: the workload's tokens and rewards are synthetic, so no warm-up
    is needed (it would cost minutes on a loaded machine and measure nothing more)."""
    path = os.path.join(root, "tiny-random")
    if not os.path.exists(os.path.join(path, "config.json")):
        from arl.models.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

        tok = build_char_tokenizer()
        save_model_dir(build_tiny_model(len(tok), seed=0), tok, path)
    return path


def common_overrides(a: argparse.Namespace, eta: int, run_root: str) -> list[str]:
    return [
        f"max_head_offpolicyness={eta}", f"learner.batch_size={a.batch}", f"total_train_steps={a.steps}",
        f"rollout.max_concurrent_rollouts={(ETA_ASYNC + 1) * a.batch}", "eval.max_prompts=1",
        "eval.every_n_steps=0", f"seed={a.seed}", "progress=false", "startup_timeout=600", f"run_dir={run_root}",
    ]


def analyse(rec: RunRecord, a: argparse.Namespace) -> dict[str, Any]:
    train = rec.train()
    evals = [m for m in rec.metrics if m.get("type") == "eval"]
    out: dict[str, Any] = {"run_dir": rec.run_dir, "steps": len(train), "error": rec.error}
    if not train or not evals:
        return out
    t0 = evals[0]["elapsed"]  # the gate opens when the first evaluation is in
    wall = train[-1]["elapsed"] - t0
    trajs = sum(m.get("n_seqs", a.batch * a.group_size) for m in train)
    hist: dict[int, int] = {}
    for m in train:
        for k, v in m.items():
            if k.startswith("stale_tokens_"):
                hist[int(k.rsplit("_", 1)[1])] = hist.get(int(k.rsplit("_", 1)[1]), 0) + int(v)
    t_open = rec.t_open if rec.t_open is not None else rec.samples[0]["t"]
    busy, batch = inference_busy(rec, t_open, t_open + wall)
    # the learner either waits for a batch or trains (step + weight export); its first wait began at start-up,
    # before the window, so idle is what training does not cover
    trained = sum(m.get("learner_step_seconds", 0.0) for m in train)
    out.update(wall_s=wall, trajectories=trajs, traj_per_s=trajs / wall if wall > 0 else math.nan,
               inference_busy=busy, mean_batch=batch, learner_idle=max(0.0, 1 - trained / wall) if wall > 0 else math.nan,
               staleness_hist=dict(sorted(hist.items())),
               max_staleness=max(hist) if hist else 0,
               max_head_offpolicyness=max(m.get("head_offpolicyness", 0) for m in train),
               stale_groups_dropped=int(train[-1].get("stale_groups_dropped", 0)),
               staleness_violations=int(train[-1].get("staleness_violations", 0)))
    return out


def print_row(name: str, r: dict) -> None:
    if "wall_s" not in r:
        print(f"  {name:6s} FAILED after {r.get('steps')} steps: {r.get('error')} (see {r['run_dir']}/logs)")
        return
    total = sum(r["staleness_hist"].values()) or 1
    hist = " ".join(f"{k}:{v / total:.0%}" for k, v in r["staleness_hist"].items())
    batch = f", mean batch {r['mean_batch']:.1f}" if not math.isnan(r["mean_batch"]) else ""
    print(f"  {name:6s} wall {r['wall_s']:7.1f} s  {r['traj_per_s']:7.2f} traj/s  inference busy "
          f"{r['inference_busy']:5.1%}{batch}  learner idle {r['learner_idle']:5.1%}  staleness [{hist}] "
          f"(max {r['max_staleness']}, {r['stale_groups_dropped']} stale groups dropped)", flush=True)


async def run_pair(a: argparse.Namespace, servers: int, root: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, eta in (("sync", 0), ("async", ETA_ASYNC)):
        build = sim_overrides if a.engine == "sim" else torch_overrides
        overrides = build(a, servers, eta) + common_overrides(a, eta, root)
        cfg = make_config(overrides)
        if a.engine == "sim":
            cfg.model.path = tokenizer_dir(root)
        else:
            cfg.model.path = tiny_model_dir(root)
        run_dir = os.path.join(root, f"{a.engine}-{servers}-{name}")
        t = time.monotonic()
        rec = await run_monitored(cfg, run_dir, timeout=a.timeout)
        r = analyse(rec, a)
        r["eta"], r["total_s"] = eta, time.monotonic() - t
        results[name] = r
        print_row(name, r)
    s, y = results["sync"], results["async"]
    if "traj_per_s" in s and "traj_per_s" in y:
        results["ratio"] = y["traj_per_s"] / s["traj_per_s"]
        ok = y["max_staleness"] <= ETA_ASYNC and s["max_staleness"] == 0
        print(f"  async/sync throughput: {results['ratio']:.2f}x   (no token staler than eta: "
              f"{'yes' if ok else 'NO'})", flush=True)
    return results


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["sim", "torch"], default="sim")
    ap.add_argument("--servers", type=int, nargs="+", default=None,
                    help="inference servers (sim default: 16 64; torch default: 1)")
    ap.add_argument("--servers-per-process", type=int, default=16, help="sim: servers one process hosts")
    ap.add_argument("--rollout-workers", type=int, default=None, help="default: sim 2, torch 1")
    ap.add_argument("--batch", type=int, default=None, help="B: prompt groups per step (sim 16, torch 4)")
    ap.add_argument("--group-size", type=int, default=None, help="trajectories per prompt (sim 16, torch 8)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (sim 8, torch 8)")
    ap.add_argument("--time-scale", type=float, default=0.2, help="sim: simulated seconds -> wall seconds")
    ap.add_argument("--len-median", type=float, default=None, help="output tokens per turn (sim 600, torch 12)")
    ap.add_argument("--len-sigma", type=float, default=None, help="log-normal shape of lengths (sim 1.0, torch 0.8)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="cap per turn (sim 8192, torch 48)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (sim 256, torch 16)")
    ap.add_argument("--max-turns", type=int, default=None, help="turns per chat: 1..max (sim 4, torch 3)")
    ap.add_argument("--tool-latency", type=float, default=None, help="median tool seconds (sim 1.0, torch 0.1)")
    ap.add_argument("--learner-s-per-token", type=float, default=1.0e-5, help="sim learner seconds per token")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="", help="run directories go here (default: a fresh dir under /tmp)")
    ap.add_argument("--json", default="", help="also write the results to this file")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    a = ap.parse_args(argv)
    sim = a.engine == "sim"
    defaults = dict(servers=[16, 64] if sim else [1], rollout_workers=2 if sim else 1, batch=16 if sim else 4,
                    group_size=16 if sim else 8, steps=8, len_median=600.0 if sim else 12.0,
                    len_sigma=1.0 if sim else 0.8, max_new_tokens=8192 if sim else 48,
                    prompt_tokens=256 if sim else 16, max_turns=4 if sim else 3, tool_latency=1.0 if sim else 0.1)
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    root = a.out or f"/tmp/arl-bench-async-{os.getpid()}"
    os.makedirs(root, exist_ok=True)
    print(f"machine: {machine()}")
    print(f"workload: engine={a.engine}, B={a.batch} groups x {a.group_size} trajectories per step, {a.steps} steps, "
          f"1-{a.max_turns} turns, output tokens per turn log-normal(median {a.len_median:g}, sigma {a.len_sigma:g}) "
          f"capped at {a.max_new_tokens}, tool latency log-normal(median {a.tool_latency:g} s, sigma 1)"
          + (f", time scale {a.time_scale:g}" if sim else ""), flush=True)
    all_results: dict[str, Any] = {"engine": a.engine, "machine": machine(), "args": vars(a), "runs": {}}
    for servers in a.servers:
        print(f"\n{servers} inference server(s):", flush=True)
        all_results["runs"][servers] = asyncio.run(run_pair(a, servers, root))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(all_results, f, indent=1, default=str)
    ok = all("ratio" in r for r in all_results["runs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
