"""What a role process runs: the run's config as it read it, and the model it loaded, as two short digests.

Why: a process that joins a running run (a scale-up, a restart on another node) must run the run's model and
config. On one host it reads the same files as everyone; on a cluster its node may hold another model under the
same path, or the run directory's config.yaml may have been edited since the start. Each role sends its digests
when it registers; the controller compares them with its own and refuses, by name, a process that differs.

The model's digest is cheap: the bytes of its small JSON files (config, tokenizer, generation config) and the name
and size of every file in its folder, not the weights' bytes (gigabytes).
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

__all__ = ["run_fingerprint", "fingerprint_mismatch"]

_SMALL = 1 << 20  # JSON files up to this size are hashed whole


def _model_digest(path: str) -> str:
    h = hashlib.sha256()
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if not os.path.isfile(full):
                continue
            size = os.path.getsize(full)
            h.update(f"{name}\0{size}\0".encode())
            if name.endswith(".json") and size <= _SMALL:
                with open(full, "rb") as f:
                    h.update(f.read())
    else:
        h.update(f"not a folder: {path}".encode())  # a hub name or a missing path: only the name
    return h.hexdigest()[:16]


def run_fingerprint(config_path: str, model_path: str) -> Optional[dict[str, str]]:
    """{"config": digest of config.yaml's bytes, "model": digest of the model folder}; None without a config file."""
    try:
        with open(config_path, "rb") as f:
            config = hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return None
    return {"config": config, "model": _model_digest(model_path)}


def fingerprint_mismatch(expected: Optional[dict], got: object) -> str:
    """'' when `got` (a registering role's) matches `expected` (the run's) or either is unknown; else what differs."""
    if not expected or not isinstance(got, dict):
        return ""
    diff = []
    if got.get("model") != expected.get("model"):
        diff.append(f"the model it loaded (model.path: its files) is not the run's (digest {got.get('model')!s:.16} "
                    f"vs {expected.get('model')})")
    if got.get("config") != expected.get("config"):
        diff.append(f"the config it read (run_dir/config.yaml) is not the one the run started with (digest "
                    f"{got.get('config')!s:.16} vs {expected.get('config')}; edited since?)")
    return "; ".join(diff)
