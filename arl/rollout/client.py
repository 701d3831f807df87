"""Client side of the inference workers: routing, request ids, timeouts.

Requests go to the worker with the least outstanding work (requested new tokens), except that the turns of one
session stay on the worker that served the session before (its prefix may still be cached there).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from typing import Any, Optional

from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig

logger = logging.getLogger("arl.rollout")


def to_request(item: Any) -> GenerateRequest:
    """Accept a GenerateRequest or the AReaL-style tuple `(qid, token_ids, gconfig)`."""
    if isinstance(item, GenerateRequest):
        return item
    if isinstance(item, tuple) and len(item) == 3:
        qid, ids, g = item
        if isinstance(g, dict):
            g = GenerationConfig.from_dict(g)
        if not isinstance(g, GenerationConfig):
            raise TypeError(f"obs_queue tuple: gconfig must be a GenerationConfig or dict, got {type(g).__name__}")
        return GenerateRequest(qid=str(qid), input_ids=ids, gconfig=g)
    raise TypeError(
        f"obs_queue items must be GenerateRequest or (qid, token_ids, gconfig), got {type(item).__name__}"
    )


class InferenceClient:
    """Sends GenerateRequests over ZMQ and matches responses back to their callers."""

    def __init__(self, dealers: list[Any], request_timeout: float = 60.0, max_sessions: int = 100_000) -> None:
        if not dealers:
            raise ValueError("InferenceClient needs at least one inference worker")
        self._dealers = dealers
        self._timeout = request_timeout
        self._load = [0] * len(dealers)
        self._pending: dict[str, tuple[asyncio.Future, int, int]] = {}
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._max_sessions = max_sessions
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self.stats = collections.Counter()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop(i)) for i in range(len(self._dealers))]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for fut, _, _ in self._pending.values():
            if not fut.done():
                fut.set_result(None)
        self._pending.clear()

    def _choose(self, session_id: Optional[str]) -> int:
        if session_id is not None and session_id in self._sticky:
            self._sticky.move_to_end(session_id)
            return self._sticky[session_id]
        idx = min(range(len(self._dealers)), key=self._load.__getitem__)
        if session_id is not None:
            self._sticky[session_id] = idx
            if len(self._sticky) > self._max_sessions:
                self._sticky.popitem(last=False)
        return idx

    def end_session(self, session_id: str) -> None:
        self._sticky.pop(session_id, None)

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        idx = self._choose(req.session_id)
        wire_id = f"{next(self._ids)}"
        work = req.gconfig.n * req.gconfig.max_new_tokens
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[wire_id] = (fut, idx, work)
        self._load[idx] += work
        wire = GenerateRequest(qid=wire_id, input_ids=req.input_ids, gconfig=req.gconfig, session_id=req.session_id)
        try:
            await self._dealers[idx].send("gen_req", wire)
            self.stats["sent"] += 1
            resp = await asyncio.wait_for(fut, self._timeout)
        except asyncio.TimeoutError:
            self.stats["timeout"] += 1
            return GenerateResponse(qid=req.qid, error=f"no response from inference worker {idx} in {self._timeout}s")
        finally:
            if self._pending.pop(wire_id, None) is not None:
                self._load[idx] -= work
        if resp is None:
            return GenerateResponse(qid=req.qid, error="inference client closed")
        resp.qid = req.qid
        return resp

    async def _recv_loop(self, idx: int) -> None:
        dealer = self._dealers[idx]
        while True:
            msg_type, resp = await dealer.recv()
            if msg_type != "gen_resp":
                self.stats["unexpected"] += 1
                continue
            entry = self._pending.pop(resp.qid, None)
            if entry is None:
                self.stats["late"] += 1  # timed out already, or a duplicate
                continue
            fut, i, work = entry
            self._load[i] -= work
            if not fut.done():
                fut.set_result(resp)
            self.stats["received"] += 1
