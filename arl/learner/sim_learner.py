"""Simulated training engine (``learner.backend=sim``): takes the time a real step would, trains nothing.

Why: with the simulated inference backend it lets a whole run (gate, routing, transport, controller, weight
updates, the learner loop and its PPO actor) be timed at cluster scale on a small machine. An optimizer step
(`train_batch`) sleeps ``step_base_s + s_per_token * tokens`` (times ``time_scale``), where tokens counts every
token of its trajectories (forward and backward run over the whole sequence); `forward_logprobs` hands back the
behaviour logprobs at no cost. The default ``s_per_token`` = 1e-5 s is a 7B model on one 8x H100 node: NeMo
Framework's published Llama-2-7B pre-training throughput of 16,934 tokens/s/GPU on 8 H100s, less a third for the
extra forward pass that recomputes the proximal log-probs (~12.7k tokens/s/GPU, ~100k tokens/s per node).

``export_weights`` writes a tiny placeholder safetensors file (one tensor holding the version) so the weight
path of the run (publish -> inference workers load -> version bump) still runs end to end.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import numpy as np

from arl.api.engine import LossFn, LossWeightFn, TrainBatch
from arl.config import SimLearnerConfig
from arl.learner.checkpoint import CHECKPOINT_STATE_FILE, latest_checkpoint, prune_checkpoints, replacing_file


class SimLearner:
    """Implements ``TrainEngine`` with sleeps (one rank); the loss function is never called."""

    rank = 0
    world_size = 1

    def __init__(self, sim: SimLearnerConfig, version: int = 0) -> None:
        self.sim = sim  # checked by the section
        self.version = int(version)

    def step_seconds(self, tokens: int) -> float:
        return (self.sim.step_base_s + self.sim.s_per_token * tokens) * self.sim.time_scale

    def forward_logprobs(self, batch: TrainBatch, temperature: float = 1.0, reference: bool = False,
                         scored_only: bool = False) -> list[np.ndarray]:
        return [t.logprobs for t in batch.trajs]

    def train_batch(self, batch: TrainBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """Sleep for the modelled step time (callers run this in a thread, like the real learner's step)."""
        seconds = self.step_seconds(sum(len(t.input_ids) for t in batch.trajs))
        time.sleep(seconds)
        return {"sim_step_seconds": seconds}

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        return values

    def export_weights(self, path: str) -> None:
        """A placeholder weights file (atomic write): the inference side checks it exists and 'loads' it."""
        from safetensors.numpy import save_file

        with replacing_file(path) as tmp:
            save_file({"sim.version": np.array([self.version], np.int64)}, tmp,
                      metadata={"format": "np", "version": str(self.version), "sim": "1"})

    def save(self, path: str, client_state: Optional[dict] = None, keep_last: Optional[int] = None) -> str:
        """The real engine's checkpoint layout with nothing but the state file: ``path/v<version>/`` holding
        `CHECKPOINT_STATE_FILE` (version and ``client_state``: the data position, counters), then ``path/latest``,
        the commit point. So a sim run resumes, and its learner restarts, like a real one (the resume tests and
        scripts/kill_resume.py run on it)."""
        tag = f"v{self.version}"
        with replacing_file(os.path.join(path, tag, CHECKPOINT_STATE_FILE)) as tmp, open(tmp, "w") as f:
            json.dump({"version": self.version, **(client_state or {})}, f)
        with replacing_file(os.path.join(path, "latest")) as tmp, open(tmp, "w") as f:
            f.write(tag)
        if keep_last is not None:
            prune_checkpoints(path, keep_last, tag)
        return os.path.join(path, tag)

    def load(self, path: str, tag: Optional[str] = None) -> dict:
        """The checkpoint ``latest`` names under ``path`` (or `tag`); returns its ``client_state``."""
        d = os.path.join(path, tag) if tag else latest_checkpoint(path)
        if d is None or not os.path.isfile(os.path.join(d, CHECKPOINT_STATE_FILE)):
            raise FileNotFoundError(f"no checkpoint found under {path!r}")
        with open(os.path.join(d, CHECKPOINT_STATE_FILE)) as f:
            state = dict(json.load(f))
        self.version = int(state.pop("version"))
        return state
