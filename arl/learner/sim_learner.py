"""Simulated learner (``learner.backend=sim``): takes the time a real step would, trains nothing.

Why: with the simulated inference backend it lets a whole run (gate, routing, transport, controller, weight
updates) be timed at cluster scale on a small machine. A step sleeps ``step_base_s + s_per_token * tokens``
(times ``time_scale``), where tokens counts every token of the batch (forward and backward run over the whole
sequence). The default ``s_per_token`` = 1e-5 s is a 7B model on one 8x H100 node: NeMo Framework's published
Llama-2-7B pre-training throughput of 16,934 tokens/s/GPU on 8 H100s, less a third for the extra forward pass
that recomputes the proximal log-probs (~12.7k tokens/s/GPU, ~100k tokens/s per node).

``export_weights`` writes a tiny placeholder safetensors file (one tensor holding the version) so the weight
path of the run (publish -> inference workers load -> version bump) still runs end to end.
"""

from __future__ import annotations

import json
import os
import time
from typing import Sequence

import numpy as np

from arl.api.types import Trajectory


class SimLearner:
    """Implements ``LearnerEngine`` with sleeps; metrics carry the same off-policyness figures as the real one."""

    def __init__(self, *, s_per_token: float = 1.0e-5, step_base_s: float = 0.5, time_scale: float = 1.0,
                 version: int = 0) -> None:
        if s_per_token < 0 or step_base_s < 0 or time_scale <= 0:
            raise ValueError("s_per_token and step_base_s must be >= 0 and time_scale > 0")
        self.s_per_token = float(s_per_token)
        self.step_base_s = float(step_base_s)
        self.time_scale = float(time_scale)
        self._version = int(version)

    @property
    def version(self) -> int:
        return self._version

    def step_seconds(self, tokens: int) -> float:
        return (self.step_base_s + self.s_per_token * tokens) * self.time_scale

    def train_step(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        """Sleep for the modelled step time (callers run this in a thread, like the real learner's step)."""
        if not batch:
            raise ValueError("train_step needs a non-empty batch")
        tokens = sum(len(t.input_ids) for t in batch)
        generated = sum(t.num_generated for t in batch)
        seconds = self.step_seconds(tokens)
        time.sleep(seconds)
        gen_versions = [t.versions[t.loss_mask.astype(bool)] for t in batch]
        gen_versions = [v for v in gen_versions if len(v)]
        vmin = min(int(v.min()) for v in gen_versions) if gen_versions else self._version
        vmax = max(int(v.max()) for v in gen_versions) if gen_versions else self._version
        rewards = np.array([t.reward for t in batch], np.float64)
        metrics = {
            "loss": 0.0,
            "reward_mean": float(rewards.mean()),
            "n_seqs": float(len(batch)),
            "n_tokens": float(tokens),
            "n_generated_tokens": float(generated),
            "head_offpolicyness": float(self._version - vmin),
            "tail_offpolicyness": float(self._version - vmax),
            "sim_step_seconds": seconds,
        }
        self._version += 1
        return metrics

    def export_weights(self, path: str) -> None:
        """A placeholder weights file (atomic write): the inference side checks it exists and 'loads' it."""
        from safetensors.numpy import save_file

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        save_file({"sim.version": np.array([self._version], np.int64)}, tmp,
                  metadata={"format": "np", "version": str(self._version), "sim": "1"})
        os.replace(tmp, path)

    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "sim_learner.json"), "w") as f:
            json.dump({"version": self._version}, f)

    def load(self, path: str) -> None:
        with open(os.path.join(path, "sim_learner.json")) as f:
            self._version = int(json.load(f)["version"])
