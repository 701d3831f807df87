"""The ``disk`` transport: the learner writes ``weights/v{N}.safetensors``, every inference server reads it.

Across hosts the run directory must be shared. A file is deleted only when the controller says no server reads its
version again (``prune_weights``, from `WeightSync.lowest_needed`), and never one of the newest `keep_versions`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from typing import Any, Awaitable, Callable, Iterable, Optional, Sequence

from arl.weights.strategy import Export, Key, Outgoing, SendLike, Transport

__all__ = ["DiskLearner", "DiskLink", "DiskLoader", "DiskTransport", "weights_path"]


def weights_path(weights_dir: str, version: int) -> str:
    """The file of `version`: the one place the layout is spelled out."""
    return os.path.join(weights_dir, f"v{version}.safetensors")


class DiskLearner:
    """Writes each version's file (`export`) and deletes those below what the controller says is still needed:
    only versions below it, and never the newest `keep_versions` (a floor: at least the newest stays)."""

    activity = "exporting weights"

    def __init__(self, weights_dir: str, keep_versions: int = 3) -> None:
        self.weights_dir = weights_dir
        self.keep_versions = max(1, keep_versions)
        self.stats: dict[str, Any] = {}
        # exported weight files, oldest first: deleted once below what the controller says is still needed
        self._exported: collections.deque[tuple[int, str]] = collections.deque()
        self.needed_from = 0  # versions below this are read by no inference server again (`prune`)
        os.makedirs(weights_dir, exist_ok=True)

    @property
    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        return {}

    @property
    def registration(self) -> dict[str, Any]:
        return {}

    async def export(self, version: int, engine: Any) -> Export:
        path = weights_path(self.weights_dir, version)
        await asyncio.to_thread(engine.export_weights, path)
        return Export(path, path)

    async def publish(self, version: int, export: Export) -> None:
        self._exported.append((version, export.path))
        self._prune()

    def prune(self, below: int) -> None:
        self.needed_from = max(self.needed_from, int(below))
        self._prune()

    def _prune(self) -> None:
        while len(self._exported) > self.keep_versions and self._exported[0][0] < self.needed_from:
            _, old = self._exported.popleft()
            with contextlib.suppress(OSError):
                os.remove(old)

    def coroutines(self) -> list[Awaitable[None]]:
        return []

    async def close(self) -> None:
        pass


class DiskLoader:
    """An inference server's side: the engine reads the file ``update_weights`` names."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def handlers(self) -> dict[str, Callable[[Any], Awaitable[None]]]:
        return {}

    def source(self, path: str) -> str:
        return path

    async def load(self, version: int, path: str) -> int:
        await self.engine.update_weights(path, version)
        return version

    async def close(self) -> None:
        pass


class DiskLink:
    """The controller's side: ``update_weights`` with the file's path is all a server needs."""

    elastic = True  # a server added mid-run needs nothing set up beforehand (`arl.ctl scale`)

    def __init__(self, weights_dir: str) -> None:
        self.weights_dir = weights_dir

    def on_register(self, msg: Any, registered: Callable[[Key], bool]) -> Outgoing:
        return []

    def updates(self, sends: Sequence[SendLike], registered: Callable[[Key], bool]) -> Outgoing:
        return [(("inference", s.server), "update_weights",
                 {"version": s.version, "path": s.path, **({"rollback": True} if s.rollback else {})})
                for s in sends]

    def resume_path(self, version: int) -> str:
        return weights_path(self.weights_dir, version)


class DiskTransport(Transport):
    name = "disk"
    carries_folders = True

    def learner(self, *, weights_dir: str, keep_versions: int, host: str, secret: Optional[bytes], device: Any,
                skip_names: Callable[[], Iterable[str]]) -> DiskLearner:
        return DiskLearner(weights_dir, keep_versions)

    def inference(self, engine: Any, *, host: str, secret: Optional[bytes]) -> DiskLoader:
        return DiskLoader(engine)

    def controller(self, *, weights_dir: str, num_servers: int, secret: Optional[bytes]) -> DiskLink:
        return DiskLink(weights_dir)

