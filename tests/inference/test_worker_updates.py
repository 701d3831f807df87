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


@pytest.mark.asyncio
async def test_a_rollback_loads_an_older_version_after_the_load_under_way_and_later_ones_go_up_from_it():
    engine, acks = SlowEngine(), []

    async def send(msg_type: str, payload: dict) -> None:
        acks.append((msg_type, payload["version"]))

    w = InferenceWorker(index=0, engine=engine, router=None, send_control=typed(send))  # type: ignore[arg-type]
    engine.gate.set()
    await w.update_weights(2, "/v2")
    engine.gate.clear()
    loading = asyncio.create_task(w.update_weights(3, "/v3"))  # a lost learner's version, still loading
    await asyncio.sleep(0)
    back = asyncio.create_task(w.update_weights(1, "/c1", rollback=True))  # its successor resumed at v1
    await asyncio.sleep(0)
    engine.gate.set()
    await asyncio.gather(loading, back)
    assert engine.loads == [2, 3, 1] and engine.version == 1
    await w.update_weights(1, "/v1")  # a plain update of what it has: ignored
    await w.update_weights(2, "/n2")  # the new learner's v2 loads, though a v2 was loaded before
    assert engine.loads == [2, 3, 1, 2] and engine.version == 2
    assert acks == [("weights_loaded", v) for v in (2, 3, 1, 2)]


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


class GatedEngine:
    """Each load waits for its version's gate, then swaps its weights in; records how many ran at once."""

    def __init__(self) -> None:
        self.version = 0
        self.gates: dict[int, asyncio.Event] = {}
        self.started: list[int] = []
        self.running = 0
        self.most_at_once = 0

    async def update_weights(self, source: str, version: int) -> None:
        self.started.append(version)
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            await self.gates.setdefault(version, asyncio.Event()).wait()
            self.version = version
        finally:
            self.running -= 1


@pytest.mark.asyncio
async def test_loads_run_one_at_a_time_and_the_newest_is_served_and_acked_last():
    """servers_per_process > 1: v6 reaches a server (through another server's message) while it still loads v5,
    and v6 finishes reading first. The loads run one after the other, the engine ends on v6, and each ack names
    the version the engine served when it was sent."""
    from tests.waiting import await_until

    engine, acks = GatedEngine(), []

    async def send(msg_type: str, payload: dict) -> None:
        acks.append((payload["version"], engine.version))

    w = InferenceWorker(index=0, engine=engine, router=None, send_control=typed(send))  # type: ignore[arg-type]
    v5 = asyncio.create_task(w.update_weights(5, "/v5"))
    await await_until(lambda: engine.started == [5])
    v6 = asyncio.create_task(w.update_weights(6, "/v6"))
    await asyncio.sleep(0.01)
    engine.gates.setdefault(6, asyncio.Event()).set()  # v6 is ready first
    await asyncio.sleep(0.01)
    engine.gates.setdefault(5, asyncio.Event()).set()
    await asyncio.gather(v5, v6)
    assert engine.most_at_once == 1
    assert engine.version == 6
    assert acks == [(5, 5), (6, 6)]


class NewerLoader:
    """A transport's side that loads the newest version it holds (as `broadcast` does), whatever was asked."""

    def __init__(self, engine: GatedEngine, newest: int) -> None:
        self.engine, self.newest = engine, newest
        self.handlers: dict = {}

    def source(self, path: str) -> str:
        return path

    async def load(self, version: int, path: str) -> int:
        await self.engine.update_weights(path, self.newest)
        return version  # reports the version asked: the ack must still name the one served


@pytest.mark.asyncio
async def test_the_ack_names_the_version_served_and_an_older_queued_load_is_skipped():
    engine, acks = GatedEngine(), []
    for v in (3, 4):
        engine.gates[v] = asyncio.Event()
        engine.gates[v].set()

    async def send(msg_type: str, payload: dict) -> None:
        acks.append(payload["version"])

    w = InferenceWorker(index=0, engine=engine, router=None, send_control=typed(send),  # type: ignore[arg-type]
                        weights=NewerLoader(engine, 4))  # type: ignore[arg-type]
    await asyncio.gather(w.update_weights(2, "/v2"), w.update_weights(3, "/v3"))
    assert engine.version == 4 and engine.started == [4] and acks == [4]
