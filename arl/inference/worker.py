"""The inference worker: serves GenerateRequests from a ROUTER socket and loads new weights when told to."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from arl.api.engine import InferenceEngine
from arl.api.types import GenerateRequest, GenerateResponse

logger = logging.getLogger("arl.inference")


class InferenceWorker:
    def __init__(self, *, index: int, engine: InferenceEngine, router: Any,
                 send_control: Callable[[str, dict], Awaitable[None]]) -> None:
        self.index = index
        self.engine = engine
        self.router = router
        self._send = send_control
        self._inflight: set[asyncio.Task] = set()
        self._t0 = time.monotonic()
        self.stats = {"requests": 0, "bad_requests": 0, "updates": 0, "update_ms_last": 0.0}

    async def serve(self) -> None:
        while True:
            ident, msg_type, payload = await self.router.recv()
            if msg_type != "gen_req" or not isinstance(payload, GenerateRequest):
                self.stats["bad_requests"] += 1
                continue
            t = asyncio.create_task(self._answer(ident, payload))
            self._inflight.add(t)
            t.add_done_callback(self._inflight.discard)

    async def _answer(self, ident: bytes, req: GenerateRequest) -> None:
        self.stats["requests"] += 1
        try:
            resp = await self.engine.agenerate(req)
        except Exception as e:  # noqa: BLE001 - the engine should not raise, but never lose a reply
            logger.exception("engine failed on %s", req.qid)
            resp = GenerateResponse(qid=req.qid, error=f"engine error: {type(e).__name__}: {e}")
        await self.router.send(ident, "gen_resp", resp)

    async def update_weights(self, version: int, path: str) -> None:
        t0 = time.perf_counter()
        await self.engine.update_weights(path, version)
        ms = (time.perf_counter() - t0) * 1000
        self.stats["updates"] += 1
        self.stats["update_ms_last"] = ms
        logger.info("loaded weights v%d from %s in %.1f ms", version, path, ms)
        await self._send("weights_loaded", {"version": version, "index": self.index, "ms": ms})

    def heartbeat_stats(self) -> dict:
        st = dict(self.stats)
        engine_stats = getattr(self.engine, "stats", None)
        if callable(engine_stats):
            st.update(engine_stats())
        st["uptime"] = time.monotonic() - self._t0
        st["version"] = self.engine.version
        return st
