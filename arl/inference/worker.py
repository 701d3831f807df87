"""The inference worker: serves GenerateRequests from a ROUTER socket and loads new weights when told to."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

from arl.api.engine import InferenceEngine
from arl.api.types import GenerateRequest, GenerateResponse
from arl.inference.routing_feed import RoutingFeed
from arl.transport.messages import SendControl, WeightsLoaded
from arl.weights.disk import DiskLoader
from arl.weights.strategy import InferenceSide

logger = logging.getLogger("arl.inference")


class InferenceWorker:
    def __init__(self, *, index: int, engine: InferenceEngine, router: Any,
                 send_control: SendControl, weights: Optional[InferenceSide] = None,
                 feed: Optional[RoutingFeed] = None) -> None:
        """`weights`: how updates reach the engine, a server's side of a weight transport
        (`arl.weights.strategy.InferenceSide`); default: the engine reads the file each update names (disk).
        `feed`: this server's reports to the rollout workers' routers (None: one server, nothing to route)."""
        self.feed = feed
        self.index = index
        self.engine = engine
        self.weights = weights if weights is not None else DiskLoader(engine)
        self.router = router
        self._send = send_control
        self._inflight: dict[tuple[bytes, str], asyncio.Task] = {}  # (peer, wire id) -> the task answering it
        self._t0 = time.monotonic()
        self._target_version = -1  # newest version being loaded (or queued to load) or loaded
        self._load_lock = asyncio.Lock()  # one weight load at a time on this engine
        self.stats = {"requests": 0, "bad_requests": 0, "updates": 0, "policy_updates": 0, "update_ms_last": 0.0,
                      "aborted": 0, "abort_unknown": 0, "update_failures": 0}

    async def serve(self) -> None:
        """Answer requests until the socket closes; raises if the engine reports its backend gone for good (an
        SGLang server that died), so the process exits and the controller fails over to the other workers."""
        wait_failed = getattr(self.engine, "wait_failed", None)
        if wait_failed is None:
            await self._serve_requests()
            return
        serving = asyncio.create_task(self._serve_requests())
        failed = asyncio.create_task(wait_failed())
        try:
            done, _ = await asyncio.wait([serving, failed], return_when=asyncio.FIRST_COMPLETED)
            if failed in done:
                raise RuntimeError(f"inference backend failed: {failed.result()}")
            serving.result()
        finally:
            for t in (serving, failed):
                t.cancel()
            await asyncio.gather(serving, failed, return_exceptions=True)

    async def _serve_requests(self) -> None:
        while True:
            ident, msg_type, payload = await self.router.recv()
            if msg_type == "gen_abort":
                self._abort(ident, payload)
                continue
            if msg_type == "route_sub":
                if self.feed is not None:
                    self.feed.subscribe(ident, payload)
                continue
            if msg_type != "gen_req" or not isinstance(payload, GenerateRequest):
                self.stats["bad_requests"] += 1
                continue
            key = (ident, payload.qid)
            self._inflight[key] = asyncio.create_task(self._answer(ident, payload, key))

    def _abort(self, ident: bytes, payload: object) -> None:
        """A client gave up on a request (re-sent elsewhere, or its trajectory ended): cancel its generation, so
        the engine stops spending decode steps on it; no answer is sent. Unknown ids (answered already) are
        counted and ignored."""
        qid = payload.get("qid") if isinstance(payload, dict) else None
        task = self._inflight.pop((ident, qid), None) if isinstance(qid, str) else None
        if task is None:
            self.stats["abort_unknown" if isinstance(qid, str) else "bad_requests"] += 1
            return
        task.cancel()
        self.stats["aborted"] += 1

    async def _answer(self, ident: bytes, req: GenerateRequest, key: tuple[bytes, str]) -> None:
        self.stats["requests"] += 1
        feed, resp = self.feed, None
        token = feed.request_started(req) if feed is not None else None
        try:
            try:
                resp = await self.engine.agenerate(req)  # a cancellation (gen_abort) cancels the engine's request
            except Exception as e:  # noqa: BLE001 - the engine should not raise, but never lose a reply
                logger.exception("engine failed on %s", req.qid)
                resp = GenerateResponse(qid=req.qid, error=f"engine error: {type(e).__name__}: {e}")
            await self.router.send(ident, "gen_resp", resp)
        finally:
            if feed is not None:
                feed.request_done(req, resp, token)
            # forget this task here, not in a done callback (one callback less per request); the identity check
            # keeps a later request under the same key (a re-send that came back here) in the table
            if self._inflight.get(key) is asyncio.current_task():
                del self._inflight[key]

    async def update_weights(self, version: int, path: str, rollback: bool = False) -> None:
        """Load `version`, unless it is not newer than the loaded or loading one: a duplicate or late update
        must never take the weights backwards (it is dropped without an ack). A load that raises is acked with
        its `error` (the weights stay as they were).

        One load at a time on this engine: the control channel runs each message's handler as its own task, and
        with several servers in a process one server's message loads every one of them, so v6 can arrive while
        v5 loads. Loads run in arrival order (newest last), one still queued when a newer version is already
        served is skipped, and the ack names the version the engine serves once its load is done.

        `rollback`: the learner was restarted from an older checkpoint: `version` loads whatever this server has
        (after a load already under way) and is acked as such; later updates go up from it."""
        if rollback:
            self._target_version = version
            async with self._load_lock:
                await self._load(version, path, rollback=True)
            return
        if version <= max(int(self.engine.version), self._target_version):
            logger.info("ignored update_weights v%d: v%d is loaded or loading", version,
                        max(int(self.engine.version), self._target_version))
            return
        self._target_version = version
        async with self._load_lock:
            if version <= int(self.engine.version):  # a load before it served this version or a newer one
                logger.info("skipped update_weights v%d: v%d is loaded", version, int(self.engine.version))
                return
            await self._load(version, path)

    async def update_policy(self, version: int, path: str, policy: str) -> None:
        """Load `version` of trainable listed policy `policy` (its adapter file, from its own learner): the other
        policies' requests go on meanwhile (the engine swaps that policy's adapter slot between decode steps).
        Acked with the policy's name; a failure is acked with its error (the adapter stays as it was)."""
        t0 = time.perf_counter()
        async with self._load_lock:
            try:
                await self.engine.update_weights(path, version, policy=policy)
            except Exception as e:  # noqa: BLE001 - acked as failed: the controller sends it again, or stops
                self.stats["update_failures"] += 1
                logger.exception("loading policy %r v%d from %s failed", policy, version, path)
                await self._send(WeightsLoaded(version=version, index=self.index, policy=policy,
                                               error=f"{type(e).__name__}: {e}"[:1000]))
                return
        ms = (time.perf_counter() - t0) * 1000
        self.stats["policy_updates"] += 1
        logger.info("loaded policy %r v%d from %s in %.1f ms", policy, version, path, ms)
        await self._send(WeightsLoaded(version=version, index=self.index, ms=ms, policy=policy))

    async def _load(self, version: int, path: str, rollback: bool = False) -> None:
        t0 = time.perf_counter()
        try:  # a broadcast sends the newest the learner holds: at least `version`
            loaded = await self.weights.load(version, path)
        except Exception as e:  # noqa: BLE001 - acked as failed: the controller retries it or fails this server
            # the weights are those it had: the same version may be sent again and must then load (unless a newer
            # one is queued behind this one: that one loads next)
            if self._target_version == version:
                self._target_version = int(self.engine.version)
            self.stats["update_failures"] += 1
            logger.exception("loading weights v%d from %s failed", version, self.weights.source(path))
            await self._send(WeightsLoaded(version=version, index=self.index, error=f"{type(e).__name__}: {e}"[:1000]))
            return
        # what the engine serves now; a transport whose engine does not count versions reports it by its return
        served = int(loaded) if rollback else max(int(loaded), int(self.engine.version))
        self._target_version = served if rollback else max(self._target_version, served)
        ms = (time.perf_counter() - t0) * 1000
        self.stats["updates"] += 1
        self.stats["update_ms_last"] = ms
        if self.feed is not None:
            self.feed.weights_loaded()
        logger.info("loaded weights v%d from %s in %.1f ms", served, self.weights.source(path), ms)
        await self._send(WeightsLoaded(version=served, index=self.index, ms=ms))

    def heartbeat_stats(self) -> dict:
        engine_stats = getattr(self.engine, "stats", None)
        st = {**self.stats, **(engine_stats() if callable(engine_stats) else {}),
              **(self.feed.stats if self.feed is not None else {}),
              "uptime": time.monotonic() - self._t0, "version": self.engine.version, "inflight": len(self._inflight)}
        return {**st, "waiting_on": self._waiting_on(st), "transport": dict(getattr(self.router, "stats", {}))}

    def _waiting_on(self, st: dict) -> str:
        """What this worker is busy with, for the controller's log if it goes silent."""
        if st.get("paused"):
            return f"a weight update (paused at v{st.get('version')})"
        running, waiting = st.get("running_requests", st.get("running")), st.get("waiting")
        if running or waiting:
            return f"decode steps ({running} requests running, {waiting} waiting)"
        return f"requests (idle; {len(self._inflight)} replies in flight)"
