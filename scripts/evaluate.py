"""Evaluate a model as a run does: `python scripts/evaluate.py MODEL_DIR_OR_CHECKPOINT [experiment=NAME] [k=v ...]`.

MODEL_DIR_OR_CHECKPOINT is a run's `final/` (or the run directory), any HF model folder, or a learner checkpoint
(`<run>/checkpoints` or `<run>/checkpoints/v<N>`). Inside a run directory the run's own config.yaml is used (with
the overrides on top); elsewhere give `experiment=NAME` (default: the built-in a+b experiment). Prints the line a
run logs for an evaluation, then the full result as JSON (first_acc, solved_acc, n, mean_turns, ...). See
`arl.evaluate`.
"""

from __future__ import annotations

import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help") or "=" in argv[0]:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help", "help") else 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from arl.api.registry import RegistryError
    from arl.config import ConfigError
    from arl.evaluate import format_result, run

    try:
        result = run(argv[0], argv[1:])
    except (ConfigError, RegistryError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_result(result))
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
