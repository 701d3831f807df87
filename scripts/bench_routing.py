"""Routing at fleet scale: one shared view (load + prefix caches of every server) vs each worker's own view.

    python scripts/bench_routing.py                  # 64 sim servers, 4 rollout workers, 4096 chats, 60 s per mode
    python scripts/bench_routing.py --duration 120 --rounds 2

Runs the real launcher twice per round, the same workload and seed each time, once per routing mode
(``inference.routing.mode=global_view`` and ``per_worker``, alternating, so the machine's noise falls on both):
simulated inference servers (an H100/7B decode-time model in real time, with a prefix cache of
``inference.sim.cache_tokens`` that a weight update flushes), the simulated learner (steps of realistic length, so
updates flush the caches every few tens of seconds, as a real run's do), and the synthetic multi-turn tool agent
whose chats share a system prompt (``--system-tokens``) and, within a group, the task (``--prompt-tokens``).
After the gate opens and ``--warmup`` seconds, it measures for ``--duration`` seconds, from the servers' heartbeats:

* prefix hits: prompt tokens served from the cache / prompt tokens (SGLang's ``cache_hit_rate``);
* prefill tokens per second (what the servers computed for prompts);
* throughput: tokens generated per second, and requests per second.

and prints ``global routing: X% prefix hits vs Y% per-worker, Zx throughput``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import inference_busy, machine, make_config, nearest, run_monitored, tokenizer_dir  # noqa: E402

MODES = ("global_view", "per_worker")


def overrides(a: argparse.Namespace, run_root: str, mode: str) -> list[str]:
    return [
        "imports=[arl.agents.sim_agent,arl.envs.sim_tool]", "agent.name=sim-agent", "env.name=sim-tool",
        f"agent.group_size={a.group_size}", f"agent.args.system_tokens={a.system_tokens}",
        f"agent.args.prompt_tokens={a.prompt_tokens}", "agent.args.max_new_tokens=8192",
        "agent.args.max_total_tokens=32000", "agent.args.length_mode=engine", f"agent.args.seed={a.seed}",
        f"env.args.latency_median_s={a.tool_latency}", "env.args.latency_sigma=1.0",
        f"env.args.time_scale={a.time_scale}",
        f"env.args.turns_min={a.turns_min}", f"env.args.turns_max={a.turns_max}",
        f"env.args.tool_tokens_median={a.tool_tokens}", f"env.args.seed={a.seed}",
        "inference.backend=sim", f"inference.num_workers={a.servers}",
        f"inference.servers_per_process={a.servers_per_process}", "inference.max_batch_size=256",
        "inference.max_context_len=32768", f"inference.sim.cache_tokens={a.cache_tokens}",
        f"inference.sim.cache_block_tokens={a.block}", f"inference.sim.len_median={a.len_median}",
        f"inference.sim.time_scale={a.time_scale}", f"learner.sim.time_scale={a.time_scale}",
        f"inference.routing.mode={mode}", f"inference.routing.block_tokens={a.block}",
        "learner.backend=sim", f"learner.batch_size={a.batch}", f"learner.sim.s_per_token={a.learner_s_per_token}",
        f"rollout.num_workers={a.rollout_workers}", f"rollout.max_concurrent_rollouts={a.groups}",
        "rollout.trajectory_timeout=3600", "rollout.request_timeout=1200",
        f"max_head_offpolicyness={a.eta}", "total_train_steps=1000000", "eval.max_prompts=1", "eval.every_n_steps=0",
        f"seed={a.seed}", "progress=false", "startup_timeout=600", f"run_dir={run_root}", *a.extra,
    ]


def measure(rec: Any, warmup: float) -> dict[str, Any]:
    t0 = (rec.t_open or rec.samples[0]["t"]) + warmup
    a0, a1 = nearest(rec.samples, t0), nearest(rec.samples, rec.t_end)
    tot = dict.fromkeys(("prompt_tokens", "prefix_hit_tokens", "prefill_tokens", "tokens_generated",
                         "requests_done", "cache_flushes"), 0.0)
    span = a1["t"] - a0["t"]
    per_server = []  # (tokens/s, steps/s) of each server: how evenly the work is spread
    for name, st in a1.get("roles", {}).items():
        if name.startswith("inference"):
            st0 = a0.get("roles", {}).get(name, {})
            for k in tot:
                tot[k] += st.get(k, 0) - st0.get(k, 0)
            per_server.append(((st.get("tokens_generated", 0) - st0.get("tokens_generated", 0)) / span,
                               (st.get("decode_steps", 0) - st0.get("decode_steps", 0)) / span))
    busy, batch = inference_busy(rec, a0["t"], a1["t"])
    p0, p1 = nearest(rec.samples, t0, "procs"), nearest(rec.samples, rec.t_end, "procs")
    cpu: dict[str, float] = {}
    for name, st in p1.get("procs", {}).items():
        st0 = p0.get("procs", {}).get(name)
        if st0 and p1["t"] > p0["t"]:
            kind = name.rstrip("0123456789")
            cpu[kind] = cpu.get(kind, 0.0) + (st["cpu"] - st0["cpu"]) / (p1["t"] - p0["t"])
    reports = sum((st.get("client") or {}).get("route_reports", 0) for name, st in a1.get("roles", {}).items()
                  if name.startswith("rollout"))
    return {"window_s": span, "route_reports": reports,
            "hit_rate": tot["prefix_hit_tokens"] / max(1.0, tot["prompt_tokens"]),
            "prefill_per_s": tot["prefill_tokens"] / span, "tokens_per_s": tot["tokens_generated"] / span,
            "requests_per_s": tot["requests_done"] / span, "flushes": tot["cache_flushes"], "servers_busy": busy,
            "mean_batch": batch, "version": a1.get("version"), "cpu": cpu, "error": rec.error,
            "server_tokens_per_s": sorted(t for t, _ in per_server),
            "server_steps_per_s": sorted(x for _, x in per_server)}


def run_one(a: argparse.Namespace, root: str, mode: str, rnd: int) -> dict[str, Any]:
    run_root = os.path.join(root, f"{mode}-{rnd}")
    os.makedirs(run_root, exist_ok=True)
    cfg = make_config(overrides(a, run_root, mode))
    cfg.model.path = tokenizer_dir(root)
    rec = asyncio.run(run_monitored(cfg, os.path.join(run_root, "run"), duration=a.duration + a.warmup,
                                    timeout=a.duration + a.warmup + 900))
    r = measure(rec, a.warmup)
    print(f"  {mode:11s} round {rnd}: prefix hits {r['hit_rate']:.1%}, prefill {r['prefill_per_s']:,.0f} tok/s, "
          f"generated {r['tokens_per_s']:,.0f} tok/s, {r['requests_per_s']:.0f} req/s, servers busy "
          f"{r['servers_busy']:.0%}, mean batch {r['mean_batch']:.1f}, {r['flushes']:.0f} cache flushes, "
          f"v{r['version']}; CPU (cores): "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["cpu"].items()))
          + (f"  ERROR {r['error']}" if r["error"] else ""), flush=True)
    q = r["server_tokens_per_s"]
    if q:
        print(f"    per server: tokens/s min {q[0]:.0f} median {q[len(q) // 2]:.0f} max {q[-1]:.0f}; steps/s median "
              f"{r['server_steps_per_s'][len(q) // 2]:.0f}", flush=True)
    return r


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=90.0, help="seconds measured per run")
    ap.add_argument("--warmup", type=float, default=45.0,
                    help="seconds after the gate opens left out (the first wave of prompts is prefilled at once)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per mode (alternating)")
    ap.add_argument("--servers", type=int, default=64)
    ap.add_argument("--servers-per-process", type=int, default=16)
    ap.add_argument("--rollout-workers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=256, help="prompt groups running at once")
    ap.add_argument("--group-size", type=int, default=16, help="chats per group (they share the task prompt)")
    ap.add_argument("--system-tokens", type=int, default=1024, help="system prompt every chat starts with")
    ap.add_argument("--prompt-tokens", type=int, default=12288,
                    help="the task (a repository's files, a document): shared by the chats of a group")
    ap.add_argument("--tool-tokens", type=float, default=512.0, help="median tokens of a tool's output")
    ap.add_argument("--tool-latency", type=float, default=0.5, help="median seconds of a tool call")
    ap.add_argument("--turns-min", type=int, default=1)
    ap.add_argument("--turns-max", type=int, default=3)
    ap.add_argument("--len-median", type=float, default=200.0, help="median tokens generated per turn")
    ap.add_argument("--cache-tokens", type=int, default=120_000, help="prefix-cache tokens per server")
    ap.add_argument("--block", type=int, default=64, help="tokens per cached / hashed block")
    ap.add_argument("--batch", type=int, default=64, help="groups per learner step")
    ap.add_argument("--learner-s-per-token", type=float, default=1e-6,
                    help="a learner step of ~15 s at the default shape: weight updates (cache flushes) as often")
    ap.add_argument("--eta", type=int, default=16, help="large: the gate does not wait for the learner")
    ap.add_argument("--time-scale", type=float, default=1.0, help="sim durations x this (< 1: faster than real)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="", help="run directory parent (default: a fresh dir under /tmp)")
    ap.add_argument("--json", default="")
    ap.add_argument("extra", nargs="*", help="more key=value overrides for every run")
    a = ap.parse_args(argv)
    root = a.out or f"/tmp/arl-bench-routing-{os.getpid()}"
    os.makedirs(root, exist_ok=True)
    print(f"machine: {machine()}")
    print(f"routing bench: {a.servers} sim servers, {a.rollout_workers} rollout workers, {a.groups} groups x "
          f"{a.group_size} chats; system {a.system_tokens} + task {a.prompt_tokens} tokens, {a.turns_min}-"
          f"{a.turns_max} turns, {a.len_median:g} tokens/turn (median), tools {a.tool_tokens:g} tokens / "
          f"{a.tool_latency:g} s; cache {a.cache_tokens:,} tokens/server in {a.block}-token blocks; "
          f"{a.duration:g} s measured after {a.warmup:g} s", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for rnd in range(a.rounds):
        for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
            runs[mode].append(run_one(a, root, mode, rnd))

    def mean(mode: str, key: str) -> float:
        return sum(r[key] for r in runs[mode]) / len(runs[mode])

    g, p = "global_view", "per_worker"
    ratio = mean(g, "tokens_per_s") / max(1e-9, mean(p, "tokens_per_s"))
    print(f"\nglobal routing: {mean(g, 'hit_rate'):.0%} prefix hits vs {mean(p, 'hit_rate'):.0%} per-worker, "
          f"{ratio:.2f}x throughput (prefill {mean(g, 'prefill_per_s'):,.0f} vs {mean(p, 'prefill_per_s'):,.0f} "
          f"tokens/s; requests {mean(g, 'requests_per_s'):.0f} vs {mean(p, 'requests_per_s'):.0f}/s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine(), "args": vars(a), "runs": runs, "throughput_ratio": ratio}, f, indent=1)
    return 1 if any(r["error"] for rs in runs.values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
