"""The inference worker loads only weight updates newer than what it has or is loading."""

from __future__ import annotations

import asyncio

import pytest

from arl.inference.worker import InferenceWorker


class SlowEngine:
    def __init__(self) -> None:
        self.version = 0
        self.loads: list[int] = []
        self.gate = asyncio.Event()

    async def update_weights(self, source: str, version: int) -> None:
        self.loads.append(version)
        await self.gate.wait()
        self.version = version


@pytest.mark.asyncio
async def test_duplicate_and_older_updates_are_ignored():
    engine, acks = SlowEngine(), []

    async def send(msg_type: str, payload: dict) -> None:
        acks.append((msg_type, payload["version"]))

    w = InferenceWorker(index=0, engine=engine, router=None, send_control=send)  # type: ignore[arg-type]
    first = asyncio.create_task(w.update_weights(2, "/v2"))
    await asyncio.sleep(0)
    await w.update_weights(2, "/v2")  # the same version while it loads
    await w.update_weights(1, "/v1")  # an older one arriving late
    engine.gate.set()
    await first
    await w.update_weights(0, "/v0")
    await w.update_weights(3, "/v3")
    assert engine.loads == [2, 3] and engine.version == 3
    assert acks == [("weights_loaded", 2), ("weights_loaded", 3)]
