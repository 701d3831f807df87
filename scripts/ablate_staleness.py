"""Staleness ablation: the default task with eta in {0, 2, 4, 8}, decoupled vs naive PPO, final greedy accuracy.

AReaL (Fu et al. 2025, Table 2 / Fig. 5) reports that naive PPO degrades as the maximum staleness eta grows while
the decoupled objective holds. This script runs ``training/main_async_ppo.py`` once per (eta, objective, seed) as
a subprocess (each run is a whole system: controller, inference, rollout and learner processes), reads each run's
``metrics.jsonl`` and writes a table to ``docs/benchmarks.md`` (its own section, replaced on every run of the
script) plus ``results.json`` in the ablation's run directory.

    python scripts/ablate_staleness.py                               # eta 0 2 4 8 x {decoupled, naive} x 3 seeds
    python scripts/ablate_staleness.py --seeds 1 2 --steps 200       # fewer steps per run, two seeds
    python scripts/ablate_staleness.py --etas 0 2 --steps 3 --no-doc learner.batch_size=2   # smoke

Extra ``key=value`` arguments are passed to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Staleness ablation: decoupled vs naive PPO"


def read_run(run_dir: str) -> dict[str, Any]:
    """Final and initial evaluation plus staleness statistics of one finished run."""
    evals, trains = [], []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            (evals if r.get("type") == "eval" else trains if r.get("type") == "train" else []).append(r)
    if not evals:
        raise RuntimeError(f"{run_dir}: no evaluation in metrics.jsonl")
    heads = [float(r.get("head_offpolicyness", 0.0)) for r in trains]
    return {
        "acc0": float(evals[0]["first_acc"]),
        "acc": float(evals[-1]["first_acc"]),
        "solved": float(evals[-1]["solved_acc"]),
        "steps": int(evals[-1]["step"]),
        "head_mean": statistics.fmean(heads) if heads else 0.0,
        "head_max": max(heads) if heads else 0.0,
        "capped_frac": statistics.fmean(float(r.get("capped_frac", 0.0)) for r in trains) if trains else 0.0,
        "clip_frac": statistics.fmean(float(r.get("clip_frac", 0.0)) for r in trains) if trains else 0.0,
        "approx_kl": statistics.fmean(float(r.get("approx_kl", 0.0)) for r in trains) if trains else 0.0,
        "best_acc": max(float(e["first_acc"]) for e in evals),
    }


def run_one(eta: int, naive: bool, seed: int, steps: Optional[int], run_root: str, extra: list[str],
            timeout: float) -> dict[str, Any]:
    name = f"eta{eta}-{'naive' if naive else 'decoupled'}-s{seed}"
    argv = [sys.executable, os.path.join(ROOT, "training", "main_async_ppo.py"), f"max_head_offpolicyness={eta}",
            f"learner.ppo.naive_ppo={'true' if naive else 'false'}", f"seed={seed}", f"run_dir={run_root}",
            f"run_name={name}", "progress=false", *([f"total_train_steps={steps}"] if steps else []), *extra]
    t0 = time.monotonic()
    log = os.path.join(run_root, f"{name}.out")
    os.makedirs(run_root, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"run {name} failed with code {proc.returncode}; see {log}")
    res = read_run(os.path.join(run_root, name))
    res.update(eta=eta, objective="naive" if naive else "decoupled", seed=seed, wall_s=wall, name=name)
    print(f"{name}: acc {res['acc0']:.3f} -> {res['acc']:.3f} (best {res['best_acc']:.3f}), head staleness mean "
          f"{res['head_mean']:.2f} max {res['head_max']:.0f}, {wall:.0f}s", flush=True)
    return res


def table(results: list[dict[str, Any]], etas: list[int], seeds: list[int]) -> str:
    lines = ["| eta | objective | final greedy accuracy (per seed) | mean ± std | head staleness mean / max | "
             "clipped tokens | approx KL | capped tokens | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for eta in etas:
        for obj in ("decoupled", "naive"):
            rs = [r for r in results if r["eta"] == eta and r["objective"] == obj]
            if not rs:
                continue
            accs = ", ".join(f"{r['acc']:.3f}" for r in sorted(rs, key=lambda r: r["seed"]))
            lines.append(
                f"| {eta} | {obj} | {accs} | {statistics.fmean(r['acc'] for r in rs):.3f} ± "
                f"{statistics.stdev(r['acc'] for r in rs) if len(rs) > 1 else 0.0:.3f} | "
                f"{statistics.fmean(r['head_mean'] for r in rs):.2f} / {max(r['head_max'] for r in rs):.0f} | "
                f"{statistics.fmean(r.get('clip_frac', 0.0) for r in rs):.4f} | "
                f"{statistics.fmean(r.get('approx_kl', 0.0) for r in rs):.5f} | "
                f"{statistics.fmean(r['capped_frac'] for r in rs):.4f} | "
                f"{statistics.fmean(r['wall_s'] for r in rs):.0f} |")
    return "\n".join(lines)


def write_doc(path: str, body: str) -> None:
    """Replace this script's section of ``path`` (or append it); other sections are left as they are."""
    text = open(path).read() if os.path.exists(path) else "# Benchmarks and measured runs\n"
    start = text.find(SECTION)
    if start >= 0:
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start].rstrip("\n") + "\n\n" + body.rstrip("\n") + "\n" + (text[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body.rstrip("\n") + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 2, 4, 8])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=None, help="total_train_steps per run (default: the config's)")
    ap.add_argument("--run-root",
                    default=os.path.join(ROOT, "runs", f"ablate-staleness-{time.strftime('%Y%m%d-%H%M%S')}"))
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    ap.add_argument("--no-doc", action="store_true", help="do not touch docs/benchmarks.md")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    ap.add_argument("--note", default="", help="text added under the table (machine load, reading, ...)")
    ap.add_argument("--from-runs", default="", help="rebuild the table from the finished runs listed in this "
                    "folder's results.json instead of running anything")
    args, extra = ap.parse_known_args(argv)
    bad = [e for e in extra if "=" not in e]
    if bad:
        ap.error(f"unrecognised arguments {bad} (overrides must be key=value)")
    results: list[dict[str, Any]] = []
    if args.from_runs:
        args.run_root = args.from_runs
        with open(os.path.join(args.run_root, "results.json")) as f:
            for old in json.load(f):
                results.append({**old, **read_run(os.path.join(args.run_root, old["name"]))})
        args.etas = sorted({r["eta"] for r in results})
        args.seeds = sorted({r["seed"] for r in results})
    for seed in [] if args.from_runs else args.seeds:
        for eta in args.etas:
            for naive in (False, True):
                results.append(run_one(eta, naive, seed, args.steps, args.run_root, extra, args.timeout))
                with open(os.path.join(args.run_root, "results.json"), "w") as f:
                    json.dump(results, f, indent=1)
    tbl = table(results, args.etas, args.seeds)
    print(tbl)
    if not args.no_doc:
        steps = args.steps or "the default 400"
        cmd = " ".join(["python scripts/ablate_staleness.py", "--etas", *map(str, args.etas), "--seeds",
                        *map(str, args.seeds), *(["--steps", str(args.steps)] if args.steps else []), *extra])
        import textwrap

        intro = (
            f"`{cmd}` ({time.strftime('%Y-%m-%d')}, {sum(r['wall_s'] for r in results):.0f} s of runs): the "
            "default experiment "
            f"with {steps} learner steps per run, `max_head_offpolicyness` = eta, decoupled PPO (default) vs naive "
            "PPO (`learner.ppo.naive_ppo=true`: the ratio is taken against the behaviour logprobs, no proximal "
            "recomputation, no behaviour-weight cap). Accuracy = greedy first-answer accuracy on the held-out "
            f"split after the last step (start: {statistics.fmean(r['acc0'] for r in results):.3f}). "
            "Head staleness = policy versions between the learner and the oldest token of each batch. Clipped "
            "tokens = share of tokens where the PPO clip was active; approx KL = mean of `logp_old - logp` on the "
            "sampled tokens (old = proximal for decoupled, behaviour for naive); capped tokens = share dropped by "
            "the behaviour-weight cap (decoupled only).")
        def fill(text: str) -> str:
            return textwrap.fill(text, 118, break_on_hyphens=False)

        note = "\n\n".join(fill(p) for p in args.note.split("\n\n")) if args.note else ""
        body = "\n".join([SECTION, "", fill(intro), "", tbl, "", *([note, ""] if note else [])])
        write_doc(args.doc, body)
        print(f"wrote section '{SECTION}' of {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
