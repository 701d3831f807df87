"""Staleness ablation: the default task at several eta, one run per (eta, objective, seed), final greedy accuracy.

AReaL (Fu et al. 2025, Table 2 / Fig. 5) reports that naive PPO degrades as the maximum staleness eta grows while
the decoupled objective holds. This script runs ``training/main_async_ppo.py`` once per (eta, variant, seed) as
a subprocess (each run is a whole system: controller, inference, rollout and learner processes), reads each run's
``metrics.jsonl`` and writes a table (and, with matplotlib, a plot) to ``docs/benchmarks.md`` (its own section,
replaced on every run of the script) plus ``results.json`` in the ablation's run directory.

Variants (``--variants``): ``decoupled`` (the default objective), ``naive`` (PPO against the behaviour logprobs),
``tis``, ``icepop``, ``cispo``, ``seq_tis``, ``mis``, ``seq_mis``, ``geo_mask``, ``gspo`` (each correction of
``learner.ppo.correction`` alone, on the decoupled objective) and
``auto`` (``max_head_offpolicyness=auto``: the controller steers eta; run once per seed, not per eta, with
``staleness_auto.eta_max`` = the largest ``--etas``).

    python scripts/ablate_staleness.py                               # eta 0 2 4 8 x {decoupled, naive} x 3 seeds
    python scripts/ablate_staleness.py --etas 1 4 8 --variants naive decoupled tis icepop cispo auto
    python scripts/ablate_staleness.py --seeds 1 2 --steps 200       # fewer steps per run, two seeds
    python scripts/ablate_staleness.py --etas 0 2 --steps 3 --no-doc learner.batch_size=2   # smoke

Extra ``key=value`` arguments are passed to every run (a larger ``learner.optimizer.lr`` is how to look for the
setting where naive PPO collapses). Per run: final and best accuracy, the step of collapse (the first evaluation
``--collapse-drop`` or more below the best before it, if any), the mismatch KL over time and throughput
(accepted groups per second of the run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Staleness ablation: decoupled vs naive PPO"
VARIANTS: dict[str, list[str]] = {  # the overrides of each variant (eta is added per run; auto's is its own)
    "decoupled": ["learner.ppo.naive_ppo=false"],
    "naive": ["learner.ppo.naive_ppo=true"],
    "tis": ["learner.ppo.correction=[tis]"],
    "icepop": ["learner.ppo.correction=[icepop]"],
    "cispo": ["learner.ppo.correction=[cispo]"],
    "seq_tis": ["learner.ppo.correction=[seq_tis]"],
    "mis": ["learner.ppo.correction=[mis]"],
    "seq_mis": ["learner.ppo.correction=[seq_mis]"],
    "geo_mask": ["learner.ppo.correction=[geo_mask]"],
    "gspo": ["learner.ppo.correction=[gspo]"],
    "auto": ["max_head_offpolicyness=auto"],
}


def collapse_step(evals: list[tuple[int, float]], drop: float) -> Optional[int]:
    """The step of the first evaluation at least `drop` below the best accuracy before it (None: no collapse)."""
    best = -1.0
    for step, acc in evals:
        if best >= 0 and acc <= best - drop:
            return step
        best = max(best, acc)
    return None


def read_run(run_dir: str, collapse_drop: float = 0.15) -> dict[str, Any]:
    """Final and initial evaluation plus staleness statistics of one finished run."""
    evals, trains, summary = [], [], {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("type") == "summary":
                summary = r
            (evals if r.get("type") == "eval" else trains if r.get("type") == "train" else []).append(r)
    if not evals:
        raise RuntimeError(f"{run_dir}: no evaluation in metrics.jsonl")
    heads = [float(r.get("head_offpolicyness", 0.0)) for r in trains]
    kl = [(int(r["step"]), float(r["mismatch_kl"])) for r in trains if "mismatch_kl" in r]
    elapsed = max((float(r.get("elapsed", 0.0)) for r in trains), default=0.0)
    accepted = float((summary.get("groups") or {}).get("accepted", 0)) or float(
        sum(int((r.get("groups") or {}).get("accepted", 0)) for r in trains[-1:]))
    etas = [int(r["admitted_eta"]) for r in trains if r.get("admitted_eta") is not None]
    return {
        "acc0": float(evals[0]["first_acc"]),
        "acc": float(evals[-1]["first_acc"]),
        "solved": float(evals[-1]["solved_acc"]),
        "steps": int(evals[-1]["step"]),
        "last_step": max((int(r["step"]) for r in trains), default=0),
        "head_mean": statistics.fmean(heads) if heads else 0.0,
        "head_max": max(heads) if heads else 0.0,
        "capped_frac": statistics.fmean(float(r.get("capped_frac", 0.0)) for r in trains) if trains else 0.0,
        "clip_frac": statistics.fmean(float(r.get("clip_frac", 0.0)) for r in trains) if trains else 0.0,
        "approx_kl": statistics.fmean(float(r.get("approx_kl", 0.0)) for r in trains) if trains else 0.0,
        "best_acc": max(float(e["first_acc"]) for e in evals),
        "collapse_step": collapse_step([(int(e["step"]), float(e["first_acc"])) for e in evals], collapse_drop),
        "curve": [[int(e["step"]), float(e["first_acc"])] for e in evals],
        "mismatch_kl": statistics.fmean(v for _, v in kl) if kl else None,
        "mismatch_kl_curve": kl[:: max(1, len(kl) // 100)],
        "groups_per_s": accepted / elapsed if elapsed > 0 else 0.0,
        "eta_mean": statistics.fmean(etas) if etas else None,
        "eta_changes": sum(1 for a, b in zip(etas, etas[1:]) if a != b),
    }


def run_with_budget(argv: list[str], log: str, timeout: float, budget: Optional[float] = None,
                    grace: float = 120.0) -> tuple[int, bool]:
    """Run `argv` (output to `log`); past `budget` seconds interrupt it (SIGINT, then a kill after `grace`) and
    return ``(exit code, True)``; past `timeout` (with no smaller budget) kill it and raise TimeoutExpired."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        cutting = budget is not None and budget < timeout
        try:
            return proc.wait(timeout=budget if cutting else timeout), False
        except subprocess.TimeoutExpired:
            if not cutting:
                proc.kill()
                proc.wait()
                raise
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=grace), True
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(), True


def run_one(eta: int, variant: str, seed: int, steps: Optional[int], run_root: str, extra: list[str],
            timeout: float, collapse_drop: float = 0.15, budget: Optional[float] = None) -> dict[str, Any]:
    """One whole run; ``variant='auto'`` steers eta itself, up to `eta` (``staleness_auto.eta_max``).

    ``budget``: seconds after which the run is interrupted (SIGINT: the launcher stops every role) and read as far as
    it got (``cut`` in the result). A collapsed run can take 5-10x a healthy one (its groups are all wrong, so
    uniform and filtered: the learner starves), which would otherwise decide how many runs an ablation affords."""
    name = f"eta{'auto' if variant == 'auto' else eta}-{variant}-s{seed}"
    knobs = [f"staleness_auto.eta_max={eta}"] if variant == "auto" else [f"max_head_offpolicyness={eta}"]
    argv = [sys.executable, os.path.join(ROOT, "training", "main_async_ppo.py"), *knobs, *VARIANTS[variant],
            f"seed={seed}", f"run_dir={run_root}",
            f"run_name={name}", "progress=false", *([f"total_train_steps={steps}"] if steps else []), *extra]
    t0 = time.monotonic()
    log = os.path.join(run_root, f"{name}.out")
    os.makedirs(run_root, exist_ok=True)
    code, cut = run_with_budget(argv, log, timeout, budget)
    wall = time.monotonic() - t0
    if code != 0 and not cut:
        raise RuntimeError(f"run {name} failed with code {code}; see {log}")
    res = read_run(os.path.join(run_root, name), collapse_drop)
    res.update(eta="auto" if variant == "auto" else eta, objective=variant, seed=seed, wall_s=wall, name=name,
               cut=cut)
    print(f"{name}: {'cut at the budget, ' if cut else ''}acc {res['acc0']:.3f} -> {res['acc']:.3f} "
          f"(best {res['best_acc']:.3f}, collapse at "
          f"{res['collapse_step']}), head staleness mean {res['head_mean']:.2f} max {res['head_max']:.0f}, "
          f"{res['groups_per_s']:.2f} groups/s, {wall:.0f}s", flush=True)
    return res


def table(results: list[dict[str, Any]], etas: list[Any], seeds: list[int]) -> str:
    lines = ["| eta | objective | final greedy accuracy (per seed) | mean ± std | best | collapse at | "
             "head staleness mean / max | clipped tokens | capped tokens | mismatch KL | groups/s | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    variants = list(dict.fromkeys(r["objective"] for r in results))
    for eta in [*etas, "auto"]:
        for obj in variants:
            rs = [r for r in results if r["eta"] == eta and r["objective"] == obj]
            if not rs:
                continue
            accs = ", ".join(f"{r['acc']:.3f}{' (cut at step ' + str(r['last_step']) + ')' if r.get('cut') else ''}"
                             for r in sorted(rs, key=lambda r: r["seed"]))
            falls = [str(r["collapse_step"]) for r in rs if r.get("collapse_step") is not None]
            kls = [r["mismatch_kl"] for r in rs if r.get("mismatch_kl") is not None]
            eta_txt = f"auto (mean {statistics.fmean(r['eta_mean'] for r in rs):.1f})" if eta == "auto" else eta
            lines.append(
                f"| {eta_txt} | {obj} | {accs} | {statistics.fmean(r['acc'] for r in rs):.3f} ± "
                f"{statistics.stdev(r['acc'] for r in rs) if len(rs) > 1 else 0.0:.3f} | "
                f"{statistics.fmean(r['best_acc'] for r in rs):.3f} | {', '.join(falls) or 'none'} | "
                f"{statistics.fmean(r['head_mean'] for r in rs):.2f} / {max(r['head_max'] for r in rs):.0f} | "
                f"{statistics.fmean(r.get('clip_frac', 0.0) for r in rs):.4f} | "
                f"{statistics.fmean(r['capped_frac'] for r in rs):.4f} | "
                f"{f'{statistics.fmean(kls):.2e}' if kls else 'n/a'} | "
                f"{statistics.fmean(r.get('groups_per_s', 0.0) for r in rs):.2f} | "
                f"{statistics.fmean(r['wall_s'] for r in rs):.0f} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> bool:
    """Accuracy over steps per run (one colour per variant, one line style per eta) and the mismatch KL over time;
    False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {v: f"C{i}" for i, v in enumerate(dict.fromkeys(r["objective"] for r in results))}
    styles = {e: s for e, s in zip(dict.fromkeys(str(r["eta"]) for r in results), ["-", "--", ":", "-.", "-"])}
    for r in results:
        label = f"{r['objective']} eta {r['eta']} s{r['seed']}"
        xs, ys = zip(*r["curve"]) if r.get("curve") else ((), ())
        ax1.plot(xs, ys, styles[str(r["eta"])], color=colours[r["objective"]], label=label, lw=1.2)
        if r.get("mismatch_kl_curve"):
            kx, ky = zip(*r["mismatch_kl_curve"])
            ax2.plot(kx, [max(v, 1e-16) for v in ky], styles[str(r["eta"])], color=colours[r["objective"]], lw=0.8)
    ax1.set(xlabel="step", ylabel="held-out greedy accuracy", title="accuracy")
    ax2.set(xlabel="step", ylabel="mismatch KL (same-version tokens)", yscale="log", title="train-inference mismatch")
    ax1.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write_doc(path: str, body: str, section: str = SECTION) -> None:
    """Replace this script's section of ``path`` (or append it); other sections are left as they are."""
    text = open(path).read() if os.path.exists(path) else "# Benchmarks and measured runs\n"
    start = text.find(section)
    if start >= 0:
        nxt = text.find("\n## ", start + len(section))
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
    ap.add_argument("--variants", nargs="+", default=["decoupled", "naive"], choices=list(VARIANTS))
    ap.add_argument("--collapse-drop", type=float, default=0.15,
                    help="a run collapsed at the first evaluation this far below its best so far")
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "ablate_staleness.png"),
                    help="where the plot goes (with the doc; needs matplotlib)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=None, help="total_train_steps per run (default: the config's)")
    ap.add_argument("--run-root",
                    default=os.path.join(ROOT, "runs", f"ablate-staleness-{time.strftime('%Y%m%d-%H%M%S')}"))
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    ap.add_argument("--no-doc", action="store_true", help="do not touch docs/benchmarks.md")
    ap.add_argument("--section", default=SECTION, help="the section of --doc this table replaces (or appends)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take (then: an error)")
    ap.add_argument("--run-budget", type=float, default=None,
                    help="seconds after which a run is interrupted and kept as far as it got (marked 'cut')")
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
                results.append({**old, **read_run(os.path.join(args.run_root, old["name"]), args.collapse_drop)})
        args.etas = sorted({r["eta"] for r in results if r["eta"] != "auto"})
        args.seeds = sorted({r["seed"] for r in results})
        args.steps = args.steps or max(r["steps"] for r in results)  # what the runs did
    plan = [(eta, v) for eta in args.etas for v in args.variants if v != "auto"]
    plan += [(max(args.etas), "auto")] if "auto" in args.variants else []
    done = os.path.join(args.run_root, "results.json")
    if not args.from_runs and os.path.exists(done):  # an interrupted or earlier ablation in this folder: add to it
        with open(done) as f:
            results = json.load(f)
        print(f"{len(results)} runs already in {done}: kept, not run again")
    for seed in [] if args.from_runs else args.seeds:
        for eta, variant in plan:
            key = ("auto" if variant == "auto" else eta, variant, seed)
            if any((r["eta"], r["objective"], r["seed"]) == key for r in results):
                continue
            results.append(run_one(eta, variant, seed, args.steps, args.run_root, extra, args.timeout,
                                   args.collapse_drop, args.run_budget))
            with open(done, "w") as f:
                json.dump(results, f, indent=1)
    args.etas = sorted({*args.etas, *(r["eta"] for r in results if r["eta"] != "auto")})
    tbl = table(results, args.etas, args.seeds)
    print(tbl)
    if not args.no_doc:
        steps = args.steps or "the default 400"
        cmd = " ".join(["python scripts/ablate_staleness.py", "--etas", *map(str, args.etas), "--variants",
                        *dict.fromkeys(r["objective"] for r in results), "--seeds",
                        *map(str, args.seeds), *(["--steps", str(args.steps)] if args.steps else []), *extra])
        import textwrap

        intro = (
            f"`{cmd}` ({time.strftime('%Y-%m-%d')}, {sum(r['wall_s'] for r in results):.0f} s of runs): the "
            "default experiment "
            f"with {steps} learner steps per run, `max_head_offpolicyness` = eta, decoupled PPO (default) vs naive "
            "PPO (`learner.ppo.naive_ppo=true`: the ratio is taken against the behaviour logprobs, no proximal "
            "recomputation, no behaviour-weight cap), and the corrections of `learner.ppo.correction` (each alone) "
            "on the decoupled objective; `auto` steers eta itself up to the largest eta (`staleness_auto.eta_max`). "
            "Accuracy = greedy first-answer accuracy on the held-out "
            f"split after the last step (start: {statistics.fmean(r['acc0'] for r in results):.3f}). "
            "Head staleness = policy versions between the learner and the oldest token of each batch. Clipped "
            "tokens = share of tokens where the PPO clip was active; capped tokens = share dropped by "
            "the behaviour-weight cap or a correction's mask; mismatch KL = mean per-step `mismatch_kl` (same-version "
            "tokens, engine vs learner); collapse = the first evaluation "
            f"{args.collapse_drop:g} or more below the best before it; groups/s = accepted groups per second of "
            "training.")
        def fill(text: str) -> str:
            return textwrap.fill(text, 118, break_on_hyphens=False)

        note = "\n\n".join(fill(p) for p in args.note.split("\n\n")) if args.note else ""
        pic = args.plot if plot(results, args.plot) else ""
        rel = os.path.relpath(pic, os.path.dirname(os.path.abspath(args.doc))) if pic else ""
        body = "\n".join([args.section, "", fill(intro), "", tbl, "", *([f"![ablation]({rel})", ""] if rel else []),
                          *([note, ""] if note else [])])
        write_doc(args.doc, body, args.section)
        print(f"wrote section '{args.section}' of {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
