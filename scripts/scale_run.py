"""Control plane at cluster scale on one machine: thousands of concurrent agent trajectories, dozens of servers.

    python scripts/scale_run.py                      # 4096 trajectories, 4 rollout workers, 64 servers, 60 s
    python scripts/scale_run.py --duration 180
    python scripts/scale_run.py --launcher ray       # the same through launcher=ray on two Ray nodes (this host)

Runs the real launcher with simulated inference servers (H100/7B decode-time model in real time by default,
``--time-scale 1``), the simulated learner and the synthetic multi-turn tool agent. `--groups` prompt groups of
`--group-size` chats run at once (default 256 x 16 = 4096 trajectories) over `--rollout-workers` processes; one
inference process hosts `--servers-per-process` servers. After the gate opens it measures for `--duration`
seconds and reports:

* the simulated servers' busy fraction (time with at least one sample decoding / wall time; from heartbeats);
* the controller's CPU share of one core (psutil: user + system time of the launcher process / wall time; it
  includes this script's sampling, a few ms per second);
* CPU share and resident memory (RSS) of every role process;
* admission latency: from a rollout worker's gate_acquire to the gate_grant that admits each group, p50/p99
  over the window (histograms from the rollout workers' heartbeats);
* requests, tokens and trajectories per second.

``--launcher ray`` starts a two-node Ray cluster on this host (``ray.cluster_utils.Cluster``; custom resources
node_a and node_b) and runs the same experiment with ``launcher=ray``: inference processes and rollout workers
alternate between the nodes, the learner sits on node_a, and the report says which node each role ran on (from
the run's ``role_placed`` records). It needs ``pip install 'arl[ray]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import fmt_bytes, inference_busy, machine, make_config, nearest, run_monitored, tokenizer_dir  # noqa: E402

from arl.utils.histogram import LogHistogram  # noqa: E402


def overrides(a: argparse.Namespace, run_root: str) -> list[str]:
    T = a.time_scale
    return [
        "imports=[arl.agents.sim_agent,arl.envs.sim_tool]", "agent.name=sim-agent", "env.name=sim-tool",
        f"agent.group_size={a.group_size}", "agent.args.prompt_tokens=256", "agent.args.max_new_tokens=8192",
        "agent.args.max_total_tokens=32000", "agent.args.length_mode=engine", f"agent.args.seed={a.seed}",
        "env.args.latency_median_s=1.0", "env.args.latency_sigma=1.0", f"env.args.time_scale={T}",
        "env.args.turns_min=1", "env.args.turns_max=4", f"env.args.seed={a.seed}",
        "inference.backend=sim", f"inference.num_workers={a.servers}",
        f"inference.servers_per_process={a.servers_per_process}", "inference.max_batch_size=256",
        "inference.max_context_len=32768", f"inference.sim.time_scale={T}",
        "learner.backend=sim", f"learner.batch_size={a.batch}", f"learner.sim.time_scale={T}",
        f"learner.sim.s_per_token={a.learner_s_per_token}", "learner.sim.step_base_s=0.5",
        f"rollout.num_workers={a.rollout_workers}", f"rollout.max_concurrent_rollouts={a.groups}",
        "rollout.trajectory_timeout=3600", "rollout.request_timeout=1200",
        f"max_head_offpolicyness={a.eta}", "total_train_steps=1000000", "eval.max_prompts=1", "eval.every_n_steps=0",
        f"seed={a.seed}", "progress=false", "startup_timeout=600", f"run_dir={run_root}",
    ]


def ray_overrides(a: argparse.Namespace, address: str) -> list[str]:
    """Alternate the role processes between the two nodes; each bundle asks for a sliver of its node's resource."""
    def alternate(n: int) -> str:
        return "[" + ", ".join(f"{{node_{'ab'[i % 2]}: 0.01}}" for i in range(n)) + "]"

    procs = -(-a.servers // a.servers_per_process)
    return ["launcher=ray", f"ray.address={address}", f"ray.placement.inference={alternate(procs)}",
            f"ray.placement.rollout={alternate(a.rollout_workers)}", "ray.placement.learner={node_a: 0.01}"]


def start_ray_cluster(cpus_per_node: int) -> Any:
    """Two Ray nodes on this host. Their CPU counts are logical: Ray schedules by them, the OS shares 2 cores."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node, "resources": {"node_a": 1}})
    c.add_node(num_cpus=cpus_per_node, resources={"node_b": 1})
    c.wait_for_nodes()
    return c


def placements(metrics: list[dict]) -> dict[str, list[str]]:
    """Node resource -> the role processes placed there (the newest record per process)."""
    where: dict[str, str] = {}
    for m in metrics:
        if m.get("type") == "role_placed":
            where[m.get("process", m.get("role", "?"))] = ",".join(m.get("node_resources") or ["?"])
    out: dict[str, list[str]] = {}
    for proc, node in sorted(where.items()):
        out.setdefault(node, []).append(proc)
    return out


def report(rec: Any, a: argparse.Namespace) -> dict[str, Any]:
    t0 = (rec.t_open or rec.samples[0]["t"]) + a.warmup
    t1 = rec.t_end
    wall = t1 - t0
    busy, batch = inference_busy(rec, t0, t1)
    first, last = nearest(rec.samples, t0, "procs"), nearest(rec.samples, t1, "procs")
    dt = last["t"] - first["t"]
    procs = {}
    for name, st in last["procs"].items():
        st0 = first["procs"].get(name)
        peak = max(s["procs"][name]["rss"] for s in rec.samples if "procs" in s and name in s["procs"])
        procs[name] = {"cpu_share": (st["cpu"] - st0["cpu"]) / dt if st0 and dt > 0 else float("nan"),
                       "rss": st["rss"], "rss_peak": peak}
    a0, a1 = nearest(rec.samples, t0), nearest(rec.samples, t1)
    hist = None
    for name, st in a1.get("roles", {}).items():
        if name.startswith("rollout") and "admission_hist" in st:
            h = LogHistogram(counts=st["admission_hist"])
            before = a0.get("roles", {}).get(name, {}).get("admission_hist")
            if before:
                h = h.minus(before)
            hist = h if hist is None else LogHistogram(counts=[x + y for x, y in zip(hist.counts, h.counts)])
    reqs = toks = 0.0
    for name, st in a1.get("roles", {}).items():
        if name.startswith("inference"):
            st0 = a0.get("roles", {}).get(name, {})
            reqs += st.get("requests_done", 0) - st0.get("requests_done", 0)
            toks += st.get("tokens_generated", 0) - st0.get("tokens_generated", 0)
    span = a1["t"] - a0["t"] if a1 and a0 else wall
    running = [s["running"] for s in rec.samples if t0 <= s["t"] <= t1]
    return {
        "window_s": wall, "servers_busy": busy, "mean_batch": batch,
        "controller_cpu_share": procs.get("controller", {}).get("cpu_share"),
        "procs": procs,
        "admission_n": hist.total if hist else 0,
        "admission_p50_ms": hist.quantile(0.5) * 1e3 if hist and hist.total else None,
        "admission_p99_ms": hist.quantile(0.99) * 1e3 if hist and hist.total else None,
        "requests_per_s": reqs / span if span > 0 else None, "tokens_per_s": toks / span if span > 0 else None,
        "groups_running_mean": sum(running) / len(running) if running else None,
        "groups_started": a1.get("started", 0) - a0.get("started", 0), "version": a1.get("version"),
        "error": rec.error,
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds measured after the gate opens")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds after the gate opens left out of the window")
    ap.add_argument("--groups", type=int, default=256, help="prompt groups running at once")
    ap.add_argument("--group-size", type=int, default=16, help="trajectories per group")
    ap.add_argument("--rollout-workers", type=int, default=4)
    ap.add_argument("--servers", type=int, default=64)
    ap.add_argument("--servers-per-process", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64, help="groups per learner step")
    ap.add_argument("--eta", type=int, default=16,
                    help="staleness bound; large by default so admissions measure the control plane, not the gate "
                         "waiting for the learner (with 4, groups wait for weight updates: p99 in seconds)")
    ap.add_argument("--learner-s-per-token", type=float, default=1e-6, help="a learner fast enough not to gate")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="", help="run directory parent (default: a fresh dir under /tmp)")
    ap.add_argument("--json", default="")
    ap.add_argument("--launcher", choices=["local", "ray"], default="local",
                    help="ray: launcher=ray on a two-node Ray cluster started on this host")
    a = ap.parse_args(argv)
    root = a.out or f"/tmp/arl-scale-run-{os.getpid()}"
    os.makedirs(root, exist_ok=True)
    print(f"machine: {machine()}")
    print(f"scale run: {a.groups} groups x {a.group_size} = {a.groups * a.group_size} concurrent trajectories, "
          f"{a.rollout_workers} rollout workers, {a.servers} simulated servers ({a.servers_per_process} per process), "
          f"time scale {a.time_scale:g}, {a.duration:g} s measured after {a.warmup:g} s warm-up", flush=True)
    cluster = None
    ov = overrides(a, root)
    if a.launcher == "ray":
        procs = -(-a.servers // a.servers_per_process)
        cluster = start_ray_cluster(cpus_per_node=procs + a.rollout_workers + 1)
        ov += ray_overrides(a, cluster.address)
    try:
        cfg = make_config(ov)
        cfg.model.path = tokenizer_dir(root)
        rec = asyncio.run(run_monitored(cfg, os.path.join(root, "run"), duration=a.duration + a.warmup,
                                        timeout=a.duration + a.warmup + 900))
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()
    r = report(rec, a)
    r["placed"] = placements(rec.metrics)
    if r["placed"]:
        print("placed: " + "; ".join(f"{node}: {len(ps)} role processes ({', '.join(ps[:3])}{', ...' if len(ps) > 3 else ''})"
                                     for node, ps in r["placed"].items()))
    if r["error"]:
        print(f"run error: {r['error']}")
    print(f"\nwindow {r['window_s']:.1f} s, groups running (mean) {r['groups_running_mean']}, "
          f"policy version at the end {r['version']}")
    print(f"servers busy:        {r['servers_busy']:.1%} (mean batch {r['mean_batch']:.1f} samples per decode step)")
    print(f"controller CPU:      {r['controller_cpu_share']:.1%} of one core")
    if r["admission_p99_ms"] is not None:
        print(f"admission latency:   p50 {r['admission_p50_ms']:.2f} ms, p99 {r['admission_p99_ms']:.2f} ms "
              f"({r['admission_n']} groups admitted in the window)")
    else:
        print("admission latency:   no group admitted in the window")
    print(f"throughput:          {r['requests_per_s']:.0f} requests/s, {r['tokens_per_s']:.0f} tokens/s (simulated), "
          f"{r['groups_started']} groups started")
    print("processes (CPU share of one core over the window, RSS at the end / peak):")
    for name, p in sorted(r["procs"].items()):
        print(f"  {name:12s} CPU {p['cpu_share']:6.1%}   RSS {fmt_bytes(p['rss'])} / {fmt_bytes(p['rss_peak'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine(), "args": vars(a), **r}, f, indent=1, default=str)
    return 1 if r["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
