"""Engine protocols: backends (embedded torch, sglang, sim; DeepSpeed learner) implement these."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

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


@runtime_checkable
class LearnerEngine(Protocol):
    @property
    def version(self) -> int: ...

    def train_step(self, batch: Sequence[Trajectory]) -> dict[str, float]: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def export_weights(self, path: str) -> None: ...
