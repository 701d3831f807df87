"""The several-policies examples over several seeds (docs/multi_policy.md): does each one learn what it claims?

Each seed runs `python training/main_async_ppo.py experiment=E seed=S` (one after another: the runs share the
machine's cores) and reads its eval records' `first_acc`:

- `self-play`: the win rate against the frozen start (0.5 at step 0, the same player on both sides), and the
  fraction of positions with a winning move where the policy took it (`traj_means.winning_moves /
  winning_chances`; the rule is take pile % 4 when that is not 0);
- `self-play-rivals`: the same for the run's policy, trained against `rival`, a policy of its own with a learner
  of its own; also the rival's training reward (its win rate against the run's policy), first and last 20 steps;
- `proposer-solver`: the solver's greedy accuracy on the held-out a+b split (it trains only on problems it wrote).

    python scripts/multi_policy_seeds.py --experiment self-play --seeds 1 2 3 [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "training", "main_async_ppo.py")


WHAT = {"self-play": "win rate vs the frozen start", "self-play-rivals": "win rate vs the frozen start",
        "proposer-solver": "solver's held-out accuracy", "proposer-solver-two": "solver's held-out accuracy"}


def policy_rewards(run_dir: str, n: int = 20) -> str:
    """Each trainable listed policy's mean training reward over its first and last `n` steps ('' without any)."""
    steps: dict[str, list[float]] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for m in map(json.loads, f):
            if m["type"] == "policy_step":
                steps.setdefault(m["policy"], []).append(m.get("reward_mean", 0.0))
    return "; ".join(f"{p} ({len(r)} steps) training reward {sum(r[:n]) / len(r[:n]):.3f} -> "
                     f"{sum(r[-n:]) / len(r[-n:]):.3f}" for p, r in steps.items() if r)


def eval_curve(run_dir: str) -> list[tuple[int, float, float]]:
    """(version, first_acc, winning moves taken / winning chances: 0 without them) per evaluation."""
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for m in map(json.loads, f):
            if m["type"] == "eval":
                means = m.get("traj_means", {})
                chances = means.get("winning_chances", 0.0)
                out.append((m["version"], m["first_acc"], means.get("winning_moves", 0.0) / chances if chances else 0.0))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", choices=sorted(WHAT), default="self-play")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--run-root", default="", help="where the runs go (default: a temporary folder)")
    ap.add_argument("overrides", nargs="*", help="key=value for every run")
    a = ap.parse_args()
    root = a.run_root or tempfile.mkdtemp(prefix=f"arl-{a.experiment}-")
    what = WHAT[a.experiment]
    rows = []
    for seed in a.seeds:
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, MAIN, f"experiment={a.experiment}", f"seed={seed}", f"run_dir={root}",
                               f"run_name=seed{seed}", "progress=false", *a.overrides], cwd=ROOT,
                              capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if done.returncode != 0:
            print(f"seed {seed}: the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            return 1
        curve = eval_curve(os.path.join(root, f"seed{seed}"))
        (_, win0, opt0), (_, win1, opt1) = curve[0], curve[-1]
        best = max(w for _, w, _ in curve)
        rows.append((win0, win1))
        moves = f"; winning moves taken {opt0:.3f} -> {opt1:.3f}" if a.experiment.startswith("self-play") else ""
        print(f"seed {seed}: {what} {win0:.3f} -> {win1:.3f} (best {best:.3f}){moves}; {seconds:.0f} s for the "
              f"command")
        print("  curve (version:first_acc" + ("/winning moves" if moves else "") + "): " +
              " ".join(f"{v}:{w:.2f}" + (f"/{o:.2f}" if moves else "") for v, w, o in curve))
        others = policy_rewards(os.path.join(root, f"seed{seed}"))
        if others:
            print("  " + others)
    rises = [round(100 * (b - a_)) for a_, b in rows]
    print(f"{a.experiment}: {what} rose by {rises} points over seeds {a.seeds} "
          f"(the bar: >= 15 on every seed: {'met' if min(rises) >= 15 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
