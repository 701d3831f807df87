"""Memory over a long run: does any role's resident memory grow with the work done?

    python scripts/soak.py                         # 100,000 groups with the built-in agent, then with the endpoint agent
    python scripts/soak.py --groups 5000 --agent builtin

Runs the real launcher (controller, rollout workers, inference workers, learner as separate processes) with the
simulated inference engine and the simulated learner, so that groups go through the whole control and data plane at
the rate the control plane allows (no model compute): the built-in multi-turn math agent (`--agent builtin`: the
queue-pair path every built-in agent takes) and the OpenAI-SDK agent of `experiment=openai-math` (`--agent endpoint`:
an HTTP session per trajectory on the rollout worker's endpoint). The learner trains every group it receives (the
sim learner's step is a sleep scaled to nothing), filters are off, and the staleness bound is wide, so every group
reaches the learner.

Each role process's RSS is sampled (psutil) every `--sample-every` seconds. Warm-up is the first `--warmup` share of
the groups (pools, caches and the allocator's arenas fill); the growth of a role is the largest RSS after warm-up
over its RSS at the end of warm-up. It prints, per phase,

    soak: N groups, max RSS growth X% (role)

and exits 1 when a growth passes `--max-growth` (percent). A role that restarted is reported and fails the soak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import machine, make_config, run_monitored, tokenizer_dir  # noqa: E402


def overrides(a: argparse.Namespace, agent: str, run_root: str) -> list[str]:
    steps = -(-a.groups // a.batch)
    common = [
        "inference.backend=sim", "inference.num_workers=1", "inference.sim.time_scale=1e-6",
        "inference.sim.len_median=3", "inference.sim.len_sigma=0.3", f"inference.sim.vocab_size={a.vocab}",
        "inference.max_batch_size=256", "learner.backend=sim", "learner.sim.time_scale=1e-6",
        f"learner.batch_size={a.batch}", f"agent.group_size={a.group_size}", "gen.max_new_tokens=4",
        f"rollout.num_workers={a.rollout_workers}", f"rollout.max_concurrent_rollouts={a.concurrency}",
        "max_head_offpolicyness=1000000", f"total_train_steps={steps}", "eval.every_n_steps=0",
        "eval.max_prompts=1", "progress=false", "startup_timeout=300", f"seed={a.seed}", f"run_dir={run_root}",
    ]
    if agent == "endpoint":
        return ["experiment=openai-math", "agent.args.filter_uniform_groups=false", *common]
    return ["agent.args.filter_uniform_groups=false", *common]


def rss_series(samples: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Role process -> [(monotonic time, RSS bytes)] from the monitor's process samples."""
    out: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for name, p in s.get("procs", {}).items():
            out.setdefault(name, []).append((s["t"], float(p["rss"])))
    return out


def growth(samples: list[dict], warm_t: float) -> dict[str, dict[str, float]]:
    """Per role: RSS (MiB) at the end of warm-up (the last sample before `warm_t`), the largest after, and the
    growth in percent."""
    out = {}
    for name, pts in rss_series(samples).items():
        before = [v for t, v in pts if t <= warm_t]
        after = [v for t, v in pts if t > warm_t]
        if not before or not after:
            continue
        base, top = before[-1], max(after)
        # the shape after warm-up: RSS at the end of each quarter of the rest (a leak climbs, a cache flattens)
        quarters = [after[min(len(after) - 1, (len(after) * q) // 4)] / 2**20 for q in (1, 2, 3, 4)]
        out[name] = {"warm_mib": base / 2**20, "max_after_mib": top / 2**20, "growth_pct": 100.0 * (top / base - 1),
                     "quarters_mib": quarters}
    return out


def warm_time(samples: list[dict], share: float, total_groups: int) -> float:
    """Monotonic time at which the learner had trained `share` of the groups (the learner's version x batch is
    not known here: the gate's `started` count is, and it leads trained groups by at most the bound)."""
    for s in samples:
        if s.get("started", 0) >= share * total_groups:
            return s["t"]
    return samples[-1]["t"]


def soak(a: argparse.Namespace, agent: str, root: str) -> dict[str, Any]:
    tok_dir = tokenizer_dir(root)
    if not a.vocab:  # the sim engine's random ids must decode: the char tokenizer's range
        from transformers import AutoTokenizer

        a.vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    cfg = make_config(overrides(a, agent, root))
    cfg.model.path = tok_dir
    run_dir = os.path.join(root, f"soak-{agent}")
    t = time.monotonic()
    rec = asyncio.run(run_monitored(cfg, run_dir, proc_every=a.sample_every, timeout=a.timeout))
    wall = time.monotonic() - t
    # while the run runs: its end (the final evaluation, report.html and curves.png) is not the steady state
    last_step = max((s.get("version", 0) for s in rec.samples), default=0)
    samples = [s for s in rec.samples if s.get("version", 0) < last_step] or rec.samples
    started = max((s.get("started", 0) for s in samples), default=0)
    t_warm = warm_time(samples, a.warmup, started)
    g = growth(samples, t_warm)
    acc = rec.summary.get("groups", {}) if rec.summary else {}
    final = next((m for m in reversed(rec.metrics) if m.get("type") == "summary"), {})
    worst = max(g.items(), key=lambda kv: kv[1]["growth_pct"]) if g else ("none", {"growth_pct": float("nan")})
    done = sum(int(v) for v in acc.values()) or started
    return {"agent": agent, "groups": done, "wall_s": wall, "error": rec.error, "growth": g, "worst": worst,
            "outcomes": acc, "restarts": {k: final.get(k) for k in ("rollout_restarts", "inference_restarts")},
            "lost_accepted_groups": final.get("lost_accepted_groups"), "metrics": os.path.join(run_dir, "metrics.jsonl")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=100_000, help="prompt groups per phase")
    ap.add_argument("--agent", choices=["builtin", "endpoint", "both"], default="both")
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="groups per learner step")
    ap.add_argument("--concurrency", type=int, default=64, help="rollout.max_concurrent_rollouts")
    ap.add_argument("--rollout-workers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=0, help="sim engine's token ids (0: the char tokenizer's size)")
    ap.add_argument("--warmup", type=float, default=0.25, help="share of the groups before the baseline")
    ap.add_argument("--sample-every", type=float, default=2.0, help="seconds between RSS samples")
    ap.add_argument("--max-growth", type=float, default=5.0, help="percent; more fails the soak")
    ap.add_argument("--timeout", type=float, default=4 * 3600.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--root", default="", help="where the runs go (default: a temporary directory)")
    ap.add_argument("--json", default="", help="also write the results here")
    a = ap.parse_args(argv)
    print(f"machine: {machine()}", flush=True)
    root = a.root or tempfile.mkdtemp(prefix="arl-soak-")
    agents = ["builtin", "endpoint"] if a.agent == "both" else [a.agent]
    results, ok = [], True
    for agent in agents:
        r = soak(a, agent, root)
        results.append(r)
        name, w = r["worst"]
        print(f"[{agent}] {r['groups']} groups in {r['wall_s']:.0f} s ({r['groups'] / max(r['wall_s'], 1e-9):.0f}/s); "
              f"outcomes {r['outcomes']}; restarts {r['restarts']}; lost accepted {r['lost_accepted_groups']}",
              flush=True)
        for role, row in sorted(r["growth"].items()):
            shape = " ".join(f"{q:.0f}" for q in row["quarters_mib"])
            print(f"  {role:12s} {row['warm_mib']:7.1f} MiB after warm-up -> max {row['max_after_mib']:7.1f} MiB "
                  f"({row['growth_pct']:+.1f}%); by quarter of the rest: {shape} MiB")
        print(f"soak: {r['groups']} groups, max RSS growth {w['growth_pct']:.1f}% ({name}) [{agent} agent]", flush=True)
        if r["error"]:
            print(f"  error: {r['error']}")
        bad_restart = any(v for v in r["restarts"].values())
        if r["error"] or bad_restart or not (w["growth_pct"] <= a.max_growth) or r["groups"] < a.groups:
            ok = False
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
