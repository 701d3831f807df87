"""Finding the latest learner checkpoint of a run without importing torch or DeepSpeed (the launcher needs it), and
the atomic file and folder writes the learner's checkpoints and exports use.

Layout (written by `DeepSpeedEngine.save`): ``<run>/checkpoints/latest`` names a tag ``v<version>``;
``<run>/checkpoints/v<version>/`` holds DeepSpeed's files and `CHECKPOINT_STATE_FILE`, a JSON dict with the policy
version and the learner worker's resume state (groups consumed, data position, counters).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterator, Optional

__all__ = ["CHECKPOINT_STATE_FILE", "CHECKPOINT_SUBDIR", "RESTART_ENV", "latest_checkpoint", "read_checkpoint_state",
           "replacing_file", "replacing_dir"]

CHECKPOINT_STATE_FILE = "arl_state.json"
CHECKPOINT_SUBDIR = "checkpoints"
# set ("1") in the environment of a learner the controller restarts after it was lost: it resumes from the newest
# checkpoint (or starts over at version 0 without one) whatever `recover` says, and tells the controller which
RESTART_ENV = "ARL_LEARNER_RESTART"


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


def prune_checkpoints(path: str, keep_last: int, current: str) -> None:
    """Delete the oldest tag folders under `path` so that `keep_last` remain, the one just written (`current`,
    ``v<version>``) among them."""
    tags = sorted((d for d in os.listdir(path) if d.startswith("v") and d[1:].isdigit() and d != current),
                  key=lambda d: int(d[1:]))
    for old in tags[: max(0, len(tags) - (keep_last - 1))]:
        shutil.rmtree(os.path.join(path, old), ignore_errors=True)


@contextlib.contextmanager
def replacing_file(path: str) -> Iterator[str]:
    """A temporary file in ``path``'s folder to write, renamed onto ``path`` when the block ends (removed if it
    raises), so readers see the old file or the whole new one."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1], dir=d)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def replacing_dir(out_dir: str, prefix: str = ".tmp-") -> Iterator[str]:
    """A sibling temporary folder to fill, swapped in for ``out_dir`` when the block ends (removed if it raises),
    so a crash leaves either the old folder or the new one."""
    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=os.path.dirname(out_dir))
    try:
        yield tmp
        if os.path.isdir(out_dir):
            old = out_dir + f".old-{os.getpid()}"
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
