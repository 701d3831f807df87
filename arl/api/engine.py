"""Engine protocols: backends (embedded torch, sglang, sim; DeepSpeed and sim training) implement these."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from arl.api.types import GenerateRequest, GenerateResponse, Trajectory


@runtime_checkable
class InferenceEngine(Protocol):
    @property
    def version(self) -> int: ...

    async def agenerate(self, req: GenerateRequest) -> GenerateResponse: ...

    async def update_weights(self, source: str, version: int) -> None:
        """Load weights from `source` (a safetensors file or directory) at a decode-step boundary."""

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def close(self) -> None: ...


@dataclasses.dataclass
class TrainBatch:
    """Trajectories plus the per-token values an algorithm attaches for the training engine.

    ``fields[name][i]`` is a scalar (spread over trajectory ``i``'s loss tokens) or an array aligned with
    ``trajs[i].input_ids``; the engine's micro-batches carry each field as a tensor of the same name, 0 off the
    loss mask (names: ``advantages``, ``token_weights``, ``prox_logp``, ``ref_logp``)."""

    trajs: list[Trajectory]
    fields: dict[str, list[Any]] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.trajs)

    def select(self, idx: Sequence[int]) -> "TrainBatch":
        return TrainBatch([self.trajs[i] for i in idx], {k: [v[i] for i in idx] for k, v in self.fields.items()})


# loss_fn(logits, micro_batch, denominator) -> scalar loss: the micro-batch's summed loss / denominator. The
# micro-batch may be a view of the positions its loss mask scores and their predecessors (the logits align with it
# as with a whole one): a loss reads logits and per-token fields under the loss mask only.
LossFn = Callable[[Any, Any, float], Any]
# loss_weight_fn(micro_batch) -> its share of the denominator (e.g. loss tokens, or scored sequences).
LossWeightFn = Callable[[Any], float]


@runtime_checkable
class TrainEngine(Protocol):
    """Forward/backward/step of one policy on this rank's data; algorithms (`arl.learner.actor`) sit on top.

    Every method is collective over the engine's ranks (each rank passes its own share of the data).

    An engine whose update forward is the same computation as `forward_logprobs` (same weights and mode, no
    dropout) may set ``prox_from_update = True``: the actor then takes the first minibatch's proximal logprobs
    from that forward instead of asking for them (one forward pass fewer per step)."""

    version: int  # policy version of the current weights; the algorithm bumps it once per batch
    rank: int
    world_size: int

    def forward_logprobs(self, batch: TrainBatch, temperature: float = 1.0, reference: bool = False,
                         scored_only: bool = False) -> list[np.ndarray]:
        """Per-token logprobs of each trajectory (aligned with its input_ids) under the current weights (or the
        frozen reference weights), no gradient. ``scored_only``: the caller reads them only where the
        trajectory's loss mask is set; elsewhere the engine may return 0 (and skip the work)."""

    def train_batch(self, batch: TrainBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """Forward/backward over micro-batches, then one optimizer step. The denominator handed to `loss_fn` is
        the sum of `loss_weight_fn` over every micro-batch of every rank (divided by the world size, as gradients
        are averaged over ranks), so the step follows the gradient of the global weighted mean however the data
        is split. Returns the engine's own figures (e.g. grad_norm, lr)."""

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """``sum`` or ``max`` of ``values`` over the ranks."""

    def save(self, path: str, client_state: Optional[dict] = None, keep_last: Optional[int] = None) -> str:
        """Checkpoint under ``path``; returns the checkpoint's directory."""

    def load(self, path: str) -> dict:
        """Load the latest checkpoint under ``path``; returns the ``client_state`` given to `save`."""

    def export_weights(self, path: str) -> None:
        """Write the weights the inference workers load (safetensors), atomically."""
