"""Recorded batches (`learner.record_batches`): every trained batch on disk, so a run can be replayed.

Why: a run that diverged is only debuggable if its steps can be re-run exactly; `scripts/replay.py` loads a
checkpoint, re-trains the recorded batches and compares with a later checkpoint bit for bit, or re-scores one
trajectory under the weights that generated it (`arl.learner.replay`).

What is recorded is the batch exactly as the actor receives it (`PPOActor.prepare`'s input, after the worker's FIFO
grouping and stale-group drop, before the actor's per-token staleness, weights, minibatch split and every forward):
per trajectory its token ids, loss mask, behaviour logprobs, per-token versions, reward, turn rewards, turn
discount, group id and prompt position (rollout worker, position), in batch order, and the policy version the step
starts from. Everything the actor computes from these is a function of them, the weights and the config, so nothing
else is needed.

Layout under ``<run>/batches/``: ``v<N>.npz`` is the batch that trained version N-1 into version N (checkpoints
are named the same way), one ``np.savez_compressed`` file per step with the arrays of the batch concatenated
(``offsets`` cut them back); ``manifest.json`` holds the format, the torch thread count of the learner and, per
config hash, the settings that decide a step's result (`replay_settings`), so a replay under another config is
refused by name. Each batch file carries its config hash too (a ``recover=auto`` run may change the config).

Cost: the file is encoded and written by one background thread (the step does not wait for it; the next step's
`record` and the end of the run do). Off (the default), nothing is built.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
from typing import Any, Optional, Sequence

import numpy as np

from arl.api.types import Trajectory
from arl.learner.checkpoint import replacing_file

__all__ = ["BATCHES_SUBDIR", "MANIFEST_FILE", "FORMAT", "RecordedBatch", "BatchRecorder", "encode_batch",
           "decode_batch", "write_batch", "read_batch", "batch_path", "recorded_versions", "read_manifest",
           "replay_settings", "settings_hash", "settings_diff"]

BATCHES_SUBDIR = "batches"
MANIFEST_FILE = "manifest.json"
FORMAT = 1
_NAME = re.compile(r"v(\d+)\.npz")

# learner settings that do not change what a step computes (where files go, how often, liveness, this very switch)
_OPERATIONAL = ("record_batches", "keep_weight_versions", "heartbeat_timeout", "checkpoint_every",
                "keep_checkpoints", "threads", "sim", "device")


@dataclasses.dataclass
class RecordedBatch:
    """One recorded step: the version it starts from, its trajectories in batch order, and its config hash."""

    version: int
    trajs: list[Trajectory]
    config_hash: str


def replay_settings(cfg: Any) -> dict[str, Any]:
    """The settings a step's result depends on, as plain JSON: the learner section (less operational keys), the
    model, the seed, the run length (the LR schedule ends at it), eta and the sampling temperature."""
    from omegaconf import OmegaConf

    learner = OmegaConf.to_container(OmegaConf.structured(cfg.learner), resolve=True)
    assert isinstance(learner, dict)
    for k in _OPERATIONAL:
        learner.pop(k, None)
    return json.loads(json.dumps({
        "learner": learner, "model.path": cfg.model.path, "seed": cfg.seed,
        "total_train_steps": cfg.total_train_steps, "max_head_offpolicyness": cfg.max_head_offpolicyness,
        "gen.temperature": cfg.gen.temperature}, sort_keys=True, default=str))


def settings_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def settings_diff(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key: recorded -> now' for every setting that differs (dotted keys, as on the command line)."""
    a, b = _flat(recorded), _flat(now)
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in sorted(set(a) | set(b))
            if a.get(k, "<absent>") != b.get(k, "<absent>")]


def encode_batch(version: int, trajs: Sequence[Trajectory], config_hash: str = "") -> dict[str, np.ndarray]:
    """The batch as a few flat arrays (the per-token ones concatenated, ``offsets`` of length n+1 cut them)."""
    lens = np.array([len(t.input_ids) for t in trajs], np.int64)
    turn_lens = np.array([len(t.turn_rewards) for t in trajs], np.int64)
    cat = (lambda name, dtype: np.concatenate([getattr(t, name) for t in trajs]).astype(dtype, copy=False)
           if trajs else np.zeros(0, dtype))
    return {
        "format": np.array(FORMAT, np.int64),
        "version": np.array(int(version), np.int64),
        "config_hash": np.array(config_hash),
        "offsets": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        "input_ids": cat("input_ids", np.int32),
        "loss_mask": cat("loss_mask", np.int8),
        "logprobs": cat("logprobs", np.float32),
        "versions": cat("versions", np.int32),
        "reward": np.array([t.reward for t in trajs], np.float64),
        "turn_offsets": np.concatenate([[0], np.cumsum(turn_lens)]).astype(np.int64),
        "turn_rewards": np.array([r for t in trajs for r in t.turn_rewards], np.float64),
        # NaN: no discount (the agent set none); the checked discount is in [0, 1] otherwise
        "turn_discount": np.array([np.nan if t.turn_discount is None else t.turn_discount for t in trajs],
                                  np.float64),
        "group_id": np.array([str(t.group_id) for t in trajs], dtype=np.str_),
        # [rollout worker, prompt-stream position] per trajectory ([-1, -1]: none): which prompts a step trained
        "prompt_pos": np.array([_prompt_pos(t) for t in trajs], np.int64).reshape(len(trajs), 2),
        # several policies: each trajectory's spans (policy, start, end) and its rewards per policy, cut by offsets
        "span_offsets": np.cumsum([0, *(len(t.policy_spans) for t in trajs)]).astype(np.int64),
        "span_policy": np.array([n for t in trajs for n, _, _ in t.policy_spans], dtype=np.str_),
        "span_bounds": np.array([[a, b] for t in trajs for _, a, b in t.policy_spans], np.int64).reshape(-1, 2),
        "preward_offsets": np.cumsum([0, *(len(t.policy_rewards) for t in trajs)]).astype(np.int64),
        "preward_policy": np.array([n for t in trajs for n in t.policy_rewards], dtype=np.str_),
        "preward_value": np.array([r for t in trajs for r in t.policy_rewards.values()], np.float64),
    }


def _prompt_pos(t: Trajectory) -> list[int]:
    pos = t.metadata.get("prompt_pos")
    try:
        return [int(pos[0]), int(pos[1])] if isinstance(pos, (list, tuple)) and len(pos) == 2 else [-1, -1]
    except (TypeError, ValueError):
        return [-1, -1]


def decode_batch(arrays: Any) -> RecordedBatch:
    """The inverse of `encode_batch` (``arrays``: a mapping such as an open npz file)."""
    fmt = int(arrays["format"])
    if fmt != FORMAT:
        raise ValueError(f"recorded batch format {fmt}, this code reads format {FORMAT}")
    off, toff = arrays["offsets"], arrays["turn_offsets"]
    ids, mask, lp, ver = (arrays[k] for k in ("input_ids", "loss_mask", "logprobs", "versions"))
    reward, tr, disc, gids = arrays["reward"], arrays["turn_rewards"], arrays["turn_discount"], arrays["group_id"]
    present = getattr(arrays, "files", arrays)
    pos = arrays["prompt_pos"] if "prompt_pos" in present else None
    multi = "span_offsets" in present  # batches recorded before several policies have none
    if multi:
        soff, spol, sb = arrays["span_offsets"], arrays["span_policy"], arrays["span_bounds"]
        roff, rpol, rval = arrays["preward_offsets"], arrays["preward_policy"], arrays["preward_value"]
    trajs = []
    for i in range(len(off) - 1):
        a, b = int(off[i]), int(off[i + 1])
        d = float(disc[i])
        trajs.append(Trajectory(input_ids=ids[a:b], loss_mask=mask[a:b], logprobs=lp[a:b], versions=ver[a:b],
                                reward=float(reward[i]), group_id=str(gids[i]),
                                turn_rewards=[float(r) for r in tr[int(toff[i]):int(toff[i + 1])]],
                                turn_discount=None if np.isnan(d) else d,
                                policy_spans=[(str(spol[j]), int(sb[j][0]), int(sb[j][1]))
                                              for j in range(int(soff[i]), int(soff[i + 1]))] if multi else [],
                                policy_rewards={str(rpol[j]): float(rval[j])
                                                for j in range(int(roff[i]), int(roff[i + 1]))} if multi else {}))
        if pos is not None and int(pos[i][1]) >= 0:
            trajs[-1].metadata["prompt_pos"] = [int(pos[i][0]), int(pos[i][1])]
    return RecordedBatch(int(arrays["version"]), trajs, str(arrays["config_hash"]))


def batch_path(batches_dir: str, version: int) -> str:
    """The file of the batch that trained `version` - 1 into `version`."""
    return os.path.join(batches_dir, f"v{int(version)}.npz")


def write_batch(batches_dir: str, version: int, trajs: Sequence[Trajectory], config_hash: str = "") -> str:
    """Write the batch that starts from `version` (atomically: a reader sees no half file); returns its path."""
    path = batch_path(batches_dir, version + 1)
    with replacing_file(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **encode_batch(version, trajs, config_hash))
    return path


def read_batch(path: str) -> RecordedBatch:
    with np.load(path, allow_pickle=False) as z:
        return decode_batch(z)


def recorded_versions(batches_dir: str) -> list[int]:
    """The versions N with a recorded ``v<N>.npz``, ascending."""
    try:
        names = os.listdir(batches_dir)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _NAME.fullmatch(n)))


def read_manifest(batches_dir: str) -> Optional[dict[str, Any]]:
    try:
        with open(os.path.join(batches_dir, MANIFEST_FILE)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


class BatchRecorder:
    """Writes each trained batch under `batches_dir` from one background thread.

    Args:
        batches_dir: ``<run>/batches``.
        settings: `replay_settings` of the run's config (kept in the manifest under its hash).
        threads: the learner's torch thread count (a CPU replay must use the same to add floats in the same
            order).
    """

    def __init__(self, batches_dir: str, settings: dict[str, Any], threads: int) -> None:
        self.dir = batches_dir
        self.config_hash = settings_hash(settings)
        os.makedirs(batches_dir, exist_ok=True)
        manifest = read_manifest(batches_dir) or {"format": FORMAT, "configs": {}}
        manifest["configs"][self.config_hash] = settings  # a recover=auto run may add a second config
        manifest.update(format=FORMAT, threads=int(threads))
        with replacing_file(os.path.join(batches_dir, MANIFEST_FILE)) as tmp, open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="arl-record")
        self._pending: Optional[concurrent.futures.Future] = None
        self.bytes_written = 0
        self.steps = 0

    def record(self, version: int, trajs: Sequence[Trajectory]) -> None:
        """Queue the batch that starts from `version`; waits for the previous one first (and raises its error)."""
        self.flush()
        self._pending = self._pool.submit(self._write, version, list(trajs))

    def _write(self, version: int, trajs: list[Trajectory]) -> None:
        path = write_batch(self.dir, version, trajs, self.config_hash)
        self.bytes_written += os.path.getsize(path)
        self.steps += 1

    def flush(self) -> None:
        """Wait for the batch being written (a write error surfaces here: the user asked for a replayable run)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def forget_after(self, version: int) -> None:
        """Delete batches of versions past `version` (a resume from checkpoint `version`: a crashed incarnation's
        later batches were never checkpointed and are trained afresh)."""
        for v in recorded_versions(self.dir):
            if v > version:
                os.unlink(batch_path(self.dir, v))

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)
