"""Build (or rebuild) a run's report: `python scripts/report.py RUN_DIR [--max-traces N] [--no-png]`.

Writes RUN_DIR/report.html (one self-contained page: curves and a trajectory browser) and RUN_DIR/curves.png
(when matplotlib is installed), from RUN_DIR/metrics.jsonl and RUN_DIR/traces.jsonl. Works on a finished run, a
running one, or one that failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl.report.page import MAX_TRACES, write_report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--max-traces", type=int, default=MAX_TRACES, help="newest traces embedded in the page")
    ap.add_argument("--no-png", action="store_true", help="skip curves.png")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not os.path.exists(os.path.join(args.run_dir, "metrics.jsonl")):
        print(f"{args.run_dir}: no metrics.jsonl (not a run directory?)", file=sys.stderr)
        return 2
    path = write_report(args.run_dir, args.max_traces, png=not args.no_png)
    print(path)
    png = os.path.join(args.run_dir, "curves.png")
    if not args.no_png and os.path.exists(png):
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
