"""Finding the latest learner checkpoint of a run without importing torch or DeepSpeed (the launcher needs it).

Layout (written by `DeepSpeedEngine.save`): ``<run>/checkpoints/latest`` names a tag ``v<version>``;
``<run>/checkpoints/v<version>/`` holds DeepSpeed's files and `CHECKPOINT_STATE_FILE`, a JSON dict with the policy
version and the learner worker's resume state (groups consumed, data position, counters).
"""

from __future__ import annotations

import json
import os
from typing import Optional

__all__ = ["CHECKPOINT_STATE_FILE", "CHECKPOINT_SUBDIR", "latest_checkpoint", "read_checkpoint_state"]

CHECKPOINT_STATE_FILE = "arl_state.json"
CHECKPOINT_SUBDIR = "checkpoints"


def latest_checkpoint(path: str) -> Optional[str]:
    """The tag directory DeepSpeed's ``latest`` file under ``path`` points to, or None (no complete checkpoint:
    ``latest`` is written last, so a save cut short leaves the previous one in place)."""
    try:
        with open(os.path.join(path, "latest")) as f:
            tag = f.read().strip()
    except OSError:
        return None
    d = os.path.join(path, tag)
    return d if tag and os.path.isdir(d) else None


def read_checkpoint_state(path: str) -> Optional[dict]:
    """The ARL state of the latest checkpoint under ``path`` (``version`` and the learner worker's state), or None
    if there is no checkpoint. Raises RuntimeError if the checkpoint has no readable state file."""
    d = latest_checkpoint(path)
    if d is None:
        return None
    try:
        with open(os.path.join(d, CHECKPOINT_STATE_FILE)) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"checkpoint {d} has no readable {CHECKPOINT_STATE_FILE}: {e}") from None
    if not isinstance(state, dict) or not isinstance(state.get("version"), int):
        raise RuntimeError(f"checkpoint {d}: {CHECKPOINT_STATE_FILE} has no integer 'version'")
    return state
