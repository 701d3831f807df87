"""`experiment=self-play` over several seeds: does the policy beat where it started, and does it learn the game?

Each seed runs `python training/main_async_ppo.py experiment=self-play seed=S` (one after another: the runs share
the machine's cores) and reads its eval records: the win rate against the frozen start (`first_acc`: 0.5 at step 0,
the same player on both sides) and the fraction of positions with a winning move where the policy took it
(`traj_means.winning_moves / winning_chances`; the rule is take pile % 4 when that is not 0).

    python scripts/self_play_seeds.py --seeds 1 2 3 [key=value ...]
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


def eval_curve(run_dir: str) -> list[tuple[int, float, float]]:
    """(version, win rate against the frozen start, winning moves taken / winning chances) per evaluation."""
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
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--run-root", default="", help="where the runs go (default: a temporary folder)")
    ap.add_argument("overrides", nargs="*", help="key=value for every run")
    a = ap.parse_args()
    root = a.run_root or tempfile.mkdtemp(prefix="arl-self-play-")
    rows = []
    for seed in a.seeds:
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, MAIN, "experiment=self-play", f"seed={seed}", f"run_dir={root}",
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
        print(f"seed {seed}: win rate vs the frozen start {win0:.3f} -> {win1:.3f} (best {best:.3f}); winning moves "
              f"taken {opt0:.3f} -> {opt1:.3f}; {seconds:.0f} s for the command")
        print("  curve (version:win rate/winning moves): " +
              " ".join(f"{v}:{w:.2f}/{o:.2f}" for v, w, o in curve))
    rises = [round(100 * (b - a_)) for a_, b in rows]
    print(f"self-play: win rate against the frozen start rose by {rises} points over seeds {a.seeds} "
          f"(the bar: >= 15 on every seed: {'met' if min(rises) >= 15 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
