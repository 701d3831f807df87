"""`inference.autoscale` against fixed fleets: the same sim run with the minimum fleet, the maximum fleet, and a
fleet that starts at the minimum and scales itself.

    python scripts/bench_autoscale.py                 # 2 vs 8 vs autoscale 2..8 servers, 50 learner steps each

Each run goes through the real launcher (simulated servers, one per process, and the simulated learner), trains
`--steps` steps and reports:

* throughput: groups trained per second, from the gate's first grant to the last step;
* server-seconds: the inference servers alive (heartbeating) summed over the run's samples, from the same start;
* for the autoscaled run, every `autoscale` record (when, which way, why).

The shape makes the fleet matter: each server decodes at most `--max-batch` samples at once, so generation grows
with servers, while the learner needs `--learner-step-s` per step, so past some fleet size it is the bottleneck.
The bar (issue 43): autoscale above the minimum fleet's throughput, below the maximum fleet's server-seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import machine, make_config, run_monitored, tokenizer_dir  # noqa: E402


def overrides(a: argparse.Namespace, run_root: str, servers: int, auto: bool) -> list[str]:
    T = a.time_scale
    tokens = a.batch * a.group_size * (64 + a.len_median)  # a step's tokens, roughly
    ov = [
        "imports=[arl.agents.sim_agent,arl.envs.sim_tool]", "agent.name=sim-agent", "env.name=sim-tool",
        f"agent.group_size={a.group_size}", "agent.args.prompt_tokens=64", "agent.args.max_new_tokens=2048",
        "agent.args.max_total_tokens=4096", "agent.args.length_mode=engine", f"agent.args.seed={a.seed}",
        "env.args.latency_median_s=0.05", "env.args.latency_sigma=0.5", f"env.args.time_scale={T}",
        "env.args.turns_min=1", "env.args.turns_max=1", f"env.args.seed={a.seed}",
        "inference.backend=sim", f"inference.num_workers={servers}", "inference.servers_per_process=1",
        f"inference.max_batch_size={a.max_batch}", "inference.max_context_len=4096",
        f"inference.sim.time_scale={T}", f"inference.sim.len_median={a.len_median}", "inference.sim.len_sigma=0.5",
        "inference.sim.update_pause_s=0.2",
        "learner.backend=sim", f"learner.batch_size={a.batch}", f"learner.sim.time_scale={T}",
        "learner.sim.step_base_s=0", f"learner.sim.s_per_token={a.learner_step_s / tokens:.3e}",
        f"rollout.max_concurrent_rollouts={a.concurrency}", "rollout.num_workers=1",
        f"max_head_offpolicyness={a.eta}", f"total_train_steps={a.steps}", "eval.max_prompts=1",
        "eval.every_n_steps=0", f"seed={a.seed}", "progress=false", "startup_timeout=300", f"run_dir={run_root}",
    ]
    if auto:
        ov += ["inference.autoscale.enabled=true", f"inference.autoscale.min_servers={a.min_servers}",
               f"inference.autoscale.max_servers={a.max_servers}",
               f"inference.autoscale.interval_s={a.interval_s}", f"inference.autoscale.cooldown_s={a.cooldown_s}"]
    return ov


def measure(rec: Any) -> dict[str, Any]:
    t0 = rec.t_open or rec.samples[0]["t"]
    steps = len(rec.train())
    server_s, prev = 0.0, None
    for s in rec.samples:
        if s["t"] < t0:
            continue
        if prev is not None:
            server_s += (s["t"] - prev["t"]) * sum(1 for n in prev["roles"] if n.startswith("inference"))
        prev = s
    wall = rec.t_end - t0
    scale = [m for m in rec.metrics if m.get("type") == "autoscale"]
    return {"steps": steps, "wall_s": wall, "server_s": server_s, "autoscale": scale, "error": rec.error}


def run_one(a: argparse.Namespace, root: str, label: str, servers: int, auto: bool) -> dict[str, Any]:
    run_root = os.path.join(root, label)
    os.makedirs(run_root, exist_ok=True)
    cfg = make_config(overrides(a, run_root, servers, auto))
    cfg.model.path = tokenizer_dir(root)
    rec = asyncio.run(run_monitored(cfg, os.path.join(run_root, "run"), timeout=3600))
    r = measure(rec)
    r["groups_per_s"] = r["steps"] * a.batch / r["wall_s"] if r["wall_s"] > 0 else 0.0
    print(f"  {label:10s}: {r['steps']} steps in {r['wall_s']:.1f} s = {r['groups_per_s']:.2f} groups/s, "
          f"{r['server_s']:.0f} server-seconds{'  ERROR ' + r['error'] if r['error'] else ''}", flush=True)
    for m in r["autoscale"]:
        fleet = len(m["servers"]) + len(m.get("joining", []))
        print(f"      {m['elapsed']:6.1f} s: autoscale {m['change']:+d} -> {fleet} servers ({m['reason']})")
    return r


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-servers", type=int, default=2)
    ap.add_argument("--max-servers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=16, help="groups per learner step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=64, help="groups running at once")
    ap.add_argument("--max-batch", type=int, default=16, help="samples one server decodes at once")
    ap.add_argument("--len-median", type=float, default=200.0)
    ap.add_argument("--learner-step-s", type=float, default=3.2, help="simulated seconds per learner step")
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--interval-s", type=float, default=4.0)
    ap.add_argument("--cooldown-s", type=float, default=6.0)
    ap.add_argument("--time-scale", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    root = a.out or f"/tmp/arl-bench-autoscale-{os.getpid()}"
    os.makedirs(root, exist_ok=True)
    print(f"machine: {machine()}")
    print(f"autoscale bench: {a.steps} steps x {a.batch} groups of {a.group_size}; servers decode <= {a.max_batch} "
          f"samples; learner {a.learner_step_s:g} s/step; time scale {a.time_scale:g}", flush=True)
    runs = {"min": run_one(a, root, f"fixed-{a.min_servers}", a.min_servers, False),
            "max": run_one(a, root, f"fixed-{a.max_servers}", a.max_servers, False),
            "auto": run_one(a, root, "autoscale", a.min_servers, True)}
    lo, hi, au = runs["min"], runs["max"], runs["auto"]
    print(f"\nautoscale: {au['groups_per_s']:.2f} groups/s vs {lo['groups_per_s']:.2f} with {a.min_servers} servers "
          f"({au['groups_per_s'] / max(1e-9, lo['groups_per_s']):.2f}x); {au['server_s']:.0f} server-seconds vs "
          f"{hi['server_s']:.0f} with {a.max_servers} ({au['server_s'] / max(1e-9, hi['server_s']):.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine(), "args": vars(a), "runs": runs}, f, indent=1, default=str)
    return 1 if any(r["error"] for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
