"""A sim run whose inference fleet is scaled mid-run: 16 -> 64 -> 8 servers by default (issue 43).

    python scripts/bench_fleet.py                          # 16 -> 64 -> 8 servers, 30 s measured at each size
    python scripts/bench_fleet.py --fleet 4,16,2 --phase-s 20

One run through the real launcher (simulated inference servers, one per process; the simulated learner; the
synthetic tool agent). Once the gate opens it measures `--phase-s` seconds at the first size, then changes the fleet
with the real command a user types (`python -m arl.ctl <run> scale inference=+N` / `-N`, over the run's control
socket) and measures again once the change is done, and so on (after `--warmup-s` first). At the end the gate admits
nothing more and the run ends once every accepted group reached the learner, as a run after its last step. It
reports, per size:

* servers serving (in the weight acks and the routing) and their decode busy fraction (from heartbeats);
* tokens generated per second and groups accepted per second over the measured window;
* for each change: how long `arl.ctl` took (a scale-up answers once the processes are started; a scale-down once
  the leaving servers are drained and stopped), and how long until every joining server served (`worker_back`);

and at the end the run's accounting: accepted groups lost (must be 0), requests re-sent after a drain.
Generation is the bottleneck by construction (a light learner, `--concurrency` groups running), so throughput
follows the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import inference_busy, machine, make_config, nearest, run_monitored, tokenizer_dir  # noqa: E402


def overrides(a: argparse.Namespace, run_root: str) -> list[str]:
    T = a.time_scale
    return [
        "imports=[arl.agents.sim_agent,arl.envs.sim_tool]", "agent.name=sim-agent", "env.name=sim-tool",
        f"agent.group_size={a.group_size}", "agent.args.prompt_tokens=128", "agent.args.max_new_tokens=2048",
        "agent.args.max_total_tokens=8192", "agent.args.length_mode=engine", f"agent.args.seed={a.seed}",
        "env.args.latency_median_s=0.2", "env.args.latency_sigma=0.5", f"env.args.time_scale={T}",
        "env.args.turns_min=1", "env.args.turns_max=2", f"env.args.seed={a.seed}",
        "inference.backend=sim", f"inference.num_workers={a.fleet[0]}", "inference.servers_per_process=1",
        f"inference.max_batch_size={a.max_batch}", "inference.max_context_len=8192",
        f"inference.sim.time_scale={T}", f"inference.sim.len_median={a.len_median}", "inference.sim.len_sigma=0.5",
        "inference.sim.update_pause_s=0.2", "inference.drain_timeout_s=60",
        "learner.backend=sim", f"learner.batch_size={a.batch}", f"learner.sim.time_scale={T}",
        "learner.sim.step_base_s=0.2", "learner.sim.s_per_token=1e-7",
        f"rollout.num_workers={a.rollout_workers}", f"rollout.max_concurrent_rollouts={a.concurrency}",
        "rollout.trajectory_timeout=3600", "rollout.request_timeout=1200",
        f"max_head_offpolicyness={a.eta}", "total_train_steps=1000000", "eval.max_prompts=1",
        "eval.every_n_steps=0", f"seed={a.seed}", "progress=false", "startup_timeout=600", f"run_dir={run_root}",
    ]


async def change_fleet(ctl: Any, run_dir: str, a: argparse.Namespace, marks: list[dict]) -> None:
    """Measure `phase_s` at each size of `a.fleet`, changing sizes with `python -m arl.ctl` in between."""
    size = a.fleet[0]
    await asyncio.sleep(a.warmup_s)  # the first groups take a while to finish: measure from a steady state
    marks.append({"size": size, "t0": time.monotonic(), "t1": time.monotonic() + a.phase_s})
    await asyncio.sleep(a.phase_s)
    for target in a.fleet[1:]:
        change = target - size
        t = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "arl.ctl", run_dir, "scale", f"inference={change:+d}", "--timeout", "600",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out = (await proc.communicate())[0].decode()
        answered = time.monotonic() - t
        while len(ctl.weights.alive()) != target:  # every joining server serves (or the leaving ones are gone)
            await asyncio.sleep(0.2)
        done = time.monotonic() - t
        print(f"  scale inference={change:+d}: arl.ctl answered in {answered:.1f} s (exit {proc.returncode}); "
              f"{target} serving after {done:.1f} s\n    {out.strip()[:300]}", flush=True)
        size = target
        marks.append({"size": size, "change": change, "answered_s": answered, "serving_after_s": done,
                      "ctl_exit": proc.returncode, "t0": time.monotonic(), "t1": time.monotonic() + a.phase_s})
        await asyncio.sleep(a.phase_s)
    # the end of a run: nothing new admitted, and the accounting waits until every accepted group reached the learner
    # (its heartbeat says so), as a run that reached its last step does
    ctl.gate.max_groups = ctl.gate.accepted + ctl.gate.running  # as a run's last step's groups: no more
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (ctl.gate.running or int(ctl.role_stats.get(("learner", 0), {}).get(
            "groups_received", 0)) < ctl.reporter.accepted_groups):
        await asyncio.sleep(0.5)


def window(rec: Any, t0: float, t1: float) -> dict[str, float]:
    """Tokens/s, groups admitted/s, serving servers and their busy fraction between t0 and t1."""
    s0, s1 = nearest(rec.samples, t0, key="t"), nearest(rec.samples, t1, key="t")
    dt = max(1e-9, s1["t"] - s0["t"])

    def tokens(s: dict) -> int:
        return sum(int(st.get("tokens_generated", 0)) for n, st in s["roles"].items() if n.startswith("inference"))

    # a server that left during the window takes its count with it: count only servers present at both ends
    both = [n for n in s1["roles"] if n.startswith("inference") and n in s0["roles"]]
    tok = sum(int(s1["roles"][n].get("tokens_generated", 0)) - int(s0["roles"][n].get("tokens_generated", 0))
              for n in both)
    busy, _ = inference_busy(rec, t0, t1)
    return {"tokens_per_s": tok / dt, "groups_per_s": (s1["accepted"] - s0["accepted"]) / dt,
            "servers": len([n for n in s1["roles"] if n.startswith("inference")]), "busy": busy,
            "total_tokens_end": tokens(s1)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet", default="16,64,8", help="server counts, the first at start")
    ap.add_argument("--phase-s", type=float, default=30.0, help="seconds measured at each size")
    ap.add_argument("--warmup-s", type=float, default=30.0, help="seconds after the gate opens before measuring")
    ap.add_argument("--rollout-workers", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=384, help="groups running at once")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="groups per learner step")
    ap.add_argument("--max-batch", type=int, default=16, help="samples one server decodes at once")
    ap.add_argument("--len-median", type=float, default=300.0)
    ap.add_argument("--eta", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    a.fleet = [int(x) for x in a.fleet.split(",")]
    if len(a.fleet) < 2 or min(a.fleet) < 1:
        ap.error("--fleet needs two or more sizes, each >= 1")
    root = a.out or f"/tmp/arl-bench-fleet-{os.getpid()}"
    os.makedirs(root, exist_ok=True)
    print(f"machine: {machine()}")
    print(f"fleet bench: servers {' -> '.join(map(str, a.fleet))}, {a.phase_s:g} s at each; {a.concurrency} groups "
          f"of {a.group_size} over {a.rollout_workers} rollout workers; a server decodes <= {a.max_batch} samples",
          flush=True)
    cfg = make_config(overrides(a, root))
    cfg.model.path = tokenizer_dir(root)
    marks: list[dict] = []
    run_dir = os.path.join(root, "run")
    rec = asyncio.run(run_monitored(cfg, run_dir, timeout=3600, sample_every=0.5,
                                    during=lambda ctl: change_fleet(ctl, run_dir, a, marks)))
    rows = []
    for mk in marks:
        w = window(rec, mk["t0"], mk["t1"])
        rows.append({**mk, **w})
    print("\n| servers | serving | tokens/s | groups accepted/s | decode busy | change: arl.ctl answered | "
          "all serving after |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ch = (f"{r['change']:+d}: {r['answered_s']:.1f} s" if "change" in r else "start")
        after = f"{r['serving_after_s']:.1f} s" if "change" in r else "-"
        print(f"| {r['size']} | {r['servers']} | {r['tokens_per_s']:.0f} | {r['groups_per_s']:.2f} | "
              f"{r['busy']:.0%} | {ch} | {after} |")
    s = ([m for m in rec.metrics if m.get("type") == "summary"] or [{}])[-1]
    resent = sum(int((st.get("client") or {}).get("resent_lost", 0)) for n, st in rec.samples[-1]["roles"].items()
                 if n.startswith("rollout"))
    print(f"\nrun: {len(rec.train())} learner steps; lost accepted groups: {s.get('lost_accepted_groups', '?')}; "
          f"requests re-sent by the clients: {resent}; error: {rec.error or 'none'}")
    scale_recs = [m for m in rec.metrics if m.get("type") == "scale"]
    for m in scale_recs:
        print(f"  {m['elapsed']:7.1f} s: scale inference {m['change']:+d}: {m['done']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine(), "args": vars(a), "phases": rows, "summary": s}, f, indent=1,
                      default=str)
    ok = all(r.get("ctl_exit", 0) == 0 for r in rows) and len(rows) == len(a.fleet)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
