"""The inference worker loads only weight updates newer than what it has or is loading."""

from __future__ import annotations

import asyncio

import pytest

from arl.inference.worker import InferenceWorker

from ..typed_control import typed


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

    w = InferenceWorker(index=0, engine=engine, router=None, send_control=typed(send))  # type: ignore[arg-type]
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


class Router:
    """In-memory ROUTER: `inbox` feeds `recv`, `sent` records the answers."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.sent: list = []

    async def recv(self):
        return await self.inbox.get()

    async def send(self, ident, msg_type, payload) -> None:
        self.sent.append((ident, msg_type, payload.qid))


class HangingEngine:
    """Generates until cancelled (it records that), or until `finish` is set."""

    version = 0

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.finish = asyncio.Event()

    async def agenerate(self, req):
        from arl.api.types import GenerateResponse

        try:
            await self.finish.wait()
        except asyncio.CancelledError:
            self.cancelled.append(req.qid)
            raise
        return GenerateResponse(qid=req.qid)


@pytest.mark.asyncio
async def test_gen_abort_stops_the_generation_and_sends_no_answer():
    import numpy as np

    from arl.api.types import GenerateRequest, GenerationConfig
    from tests.waiting import await_until

    engine, router = HangingEngine(), Router()
    w = InferenceWorker(index=0, engine=engine, router=router, send_control=None)  # type: ignore[arg-type]
    serving = asyncio.create_task(w.serve())
    for peer, qid in ((b"A", "1"), (b"A", "2"), (b"B", "1")):  # wire ids are per client: peer B's "1" is another
        router.inbox.put_nowait((peer, "gen_req", GenerateRequest(qid=qid, input_ids=np.arange(3, dtype=np.int32),
                                                                  gconfig=GenerationConfig())))
    await await_until(lambda: len(w._inflight) == 3)
    router.inbox.put_nowait((b"A", "gen_abort", {"qid": "1"}))
    router.inbox.put_nowait((b"A", "gen_abort", {"qid": "9"}))  # unknown (answered already): counted, ignored
    await await_until(lambda: engine.cancelled == ["1"] and w.stats["abort_unknown"] == 1)
    engine.finish.set()
    await await_until(lambda: len(router.sent) == 2)
    assert sorted(router.sent) == [(b"A", "gen_resp", "2"), (b"B", "gen_resp", "1")]
    assert w.stats["aborted"] == 1 and w._inflight == {}
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)


class FailOnceEngine:
    """Its first weight load raises (a read error); later ones load."""

    def __init__(self) -> None:
        self.version = 0
        self.calls = 0

    async def update_weights(self, source: str, version: int) -> None:
        self.calls += 1
        if self.calls == 1:
            raise OSError(f"cannot read {source}")
        self.version = version


@pytest.mark.asyncio
async def test_a_failed_load_is_acked_as_failed_and_the_same_version_loads_on_retry():
    """A load that raises must not leave the worker silent with its target set: the controller hears of the failure
    (then retries) and the retry of the same version loads."""
    engine, acks = FailOnceEngine(), []

    async def send(msg_type: str, payload: dict) -> None:
        acks.append((msg_type, payload))

    w = InferenceWorker(index=1, engine=engine, router=None, send_control=typed(send))  # type: ignore[arg-type]
    await w.update_weights(2, "/v2")  # no exception out of it: the failure is reported
    assert engine.version == 0 and w.stats["update_failures"] == 1
    assert acks == [("weights_loaded", {"version": 2, "index": 1, "error": "OSError: cannot read /v2"})]
    await w.update_weights(2, "/v2")  # the controller's retry
    assert engine.version == 2 and acks[-1][0] == "weights_loaded" and "error" not in acks[-1][1]
    assert acks[-1][1]["version"] == 2 and w.stats["updates"] == 1
