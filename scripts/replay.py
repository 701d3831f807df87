"""Replay a run from its recorded batches (a run trained with `learner.record_batches=true`):

    python scripts/replay.py runs/<run> --from v<a> --to v<b>
        load checkpoint a, re-train the recorded batches a+1..b as the learner did, and say whether the weights
        equal checkpoint b bit for bit (exit 0 if they do, 1 if not)
    python scripts/replay.py runs/<run> --trajectory <group>[#k]
        re-score a trajectory (a trace's "group" in traces.jsonl; #k: the k-th of that group) under the weights
        of the versions that generated it: per-token |engine logprob - learner logprob|, max, mean, worst tokens

Missing input (no recorded batches, a checkpoint not kept, a batch not recorded, another config) exits 2 with what
is missing. See docs/reliability.md, "Replaying a run", and `arl.replay`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="the run directory (runs/<run>)")
    ap.add_argument("--from", dest="start", help="checkpoint version to start from (v<a>)")
    ap.add_argument("--to", dest="end", help="checkpoint version to reproduce (v<b>)")
    ap.add_argument("--trajectory", help="re-score this trajectory: <group id> as in traces.jsonl, optionally #k")
    ap.add_argument("--worst", type=int, default=5, help="worst tokens to list per trajectory")
    args = ap.parse_args(argv)
    if (args.start is None) != (args.end is None) or (args.start is None and args.trajectory is None):
        ap.error("give --from v<a> --to v<b>, or --trajectory <id>")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from arl.replay import ReplayError, format_rescore, format_steps, parse_version, replay_steps, rescore

    code = 0
    try:
        if args.start is not None:
            result = replay_steps(args.run_dir, parse_version(args.start), parse_version(args.end))
            print(format_steps(result), flush=True)
            code = 0 if result.equal else 1
        if args.trajectory is not None:
            for r in rescore(args.run_dir, args.trajectory):
                print(format_rescore(r, args.worst), flush=True)
    except ReplayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
