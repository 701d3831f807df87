"""Client side of the inference workers: routing, request ids, timeouts.

Requests go to the worker with the least outstanding work (requested new tokens), except that the turns of one
session stay on the worker that served the session before (its prefix may still be cached there). The sticky
mapping is forgotten when the policy version changes (learned from the responses' `output_versions`, or told with
`set_version`): after an update no worker holds a prefix computed by the current policy, so balance wins again.
With a `RoutingView` (``inference.routing.mode=global_view``, several servers) the choice is its score instead:
every server's load from every rollout worker and the prefix blocks it has cached (`arl.rollout.routing`); the
client subscribes to each server's reports over the same DEALER and renews the subscription while it runs.

A worker that is lost (the controller says so with `worker_lost`) gets no new requests, and its outstanding
requests are re-sent to the remaining workers under the same wire id: whichever answer comes first is used, a later
duplicate is dropped and counted as "late".

Deadlines scale with the generation budget, so they do not cut long answers more often than short ones (which
would push the policy toward short answers): an attempt may take ``request_timeout + timeout_per_token *
max_new_tokens`` seconds (checked by one sweep per client every ``min(1 s, request_timeout / 8)``, so an attempt
expires up to that much late; a loop timer per request cost ~15 Python calls per round trip). An attempt past
its deadline is re-sent to another worker (while attempts remain) and
the original is aborted (``gen_abort``: its worker stops generating it), so the work is not done twice; a request
its caller gives up on (out of attempts, or the trajectory was cancelled) is aborted too, and so is a re-sent attempt
when an earlier one answers first. Re-sends and aborts are counted in `stats`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from typing import Any, Optional, Sequence

from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig
from arl.rollout.routing import RoutingView
from arl.transport.messages import GenAbort
from arl.utils.prefix_hash import prefix_hashes

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


_TIMEOUT = object()  # what an attempt's future holds when its time ran out
_SWEEP_MAX_S = 1.0  # the longest pause between two deadline sweeps
_RENEW_S = 10.0  # routing subscriptions are renewed this often (a server forgets one after 30 s)


@dataclasses.dataclass(slots=True, eq=False)
class _Pending:
    """One request in flight: its wire form (for re-sending), the worker it sits on, and its weight in the load."""

    future: asyncio.Future
    wire: GenerateRequest
    work: int
    idx: int = -1
    attempts: int = 0
    expires: float = 0.0  # time.monotonic() past which the current attempt has timed out
    answered_by: int = -1


class InferenceClient:
    """Sends GenerateRequests over ZMQ and matches responses back to their callers.

    Args:
        dealers: one connected DEALER per inference worker (index = worker index).
        request_timeout: seconds one attempt may wait for its answer, plus `timeout_per_token` seconds per token
            of the request's ``max_new_tokens``.
        max_sessions: sticky sessions remembered (LRU): well above the sessions alive at once (one per running
            trajectory); a forgotten one only loses its stickiness. Bounded so a long run's worker stays flat.
        max_attempts: sends of one request in all (a timed-out attempt is re-sent to another live worker while
            attempts remain; re-sends after a worker is lost do not count).
        view: the servers' shared load and cache view (`arl.rollout.routing`); None: this client's own least-load
            and sticky sessions.
        placement: listed policy -> the servers that serve it (`policies.<name>.servers`); a request of such a
            policy goes only to those. A policy not in it is on every server.
    """

    def __init__(self, dealers: list[Any], request_timeout: float = 60.0, max_sessions: int = 16_384,
                 max_attempts: int = 2, timeout_per_token: float = 0.0, view: Optional[RoutingView] = None,
                 placement: Optional[dict[str, Sequence[int]]] = None) -> None:
        if not dealers:
            raise ValueError("InferenceClient needs at least one inference worker")
        if request_timeout <= 0 or timeout_per_token < 0:
            raise ValueError("request_timeout must be > 0 and timeout_per_token >= 0")
        self._dealers = dealers
        self._timeout = request_timeout
        self._per_token = timeout_per_token
        self._aborts: set[asyncio.Task] = set()
        self._closing = False
        self._max_attempts = max(1, max_attempts)
        self._load = [0] * len(dealers)
        self._reqs = [0] * len(dealers)  # requests in flight per worker (the view's load unit)
        self._view = view
        self._alive = [True] * len(dealers)
        self._draining: set[int] = set()  # leaving the run: no new requests, the ones in flight finish there
        self._placed = {p: frozenset(servers) for p, servers in (placement or {}).items()}
        self._pending: dict[str, _Pending] = {}
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._max_sessions = max_sessions
        self._version = -1
        self._ids = itertools.count()
        self._tasks: dict[int, asyncio.Task] = {}  # worker index -> its receive loop (once started)
        self._started = False
        self._renewer: Optional[asyncio.Task] = None
        self._sweep_every = min(_SWEEP_MAX_S, request_timeout / 8)
        self._sweeper: Optional[asyncio.TimerHandle] = None
        self._sweep_loop: Optional[asyncio.AbstractEventLoop] = None  # None while no sweep is scheduled
        self._back = asyncio.Event()  # set (and replaced) when a lost worker is back
        self.stats = collections.Counter()
        if view is not None:
            view.stats = self.stats  # its routing counts travel with the client's (heartbeats)

    @property
    def version(self) -> int:
        """Newest policy version seen in a response (or set with `set_version`); -1 before any."""
        return self._version

    @property
    def alive(self) -> list[int]:
        return [i for i, a in enumerate(self._alive) if a]

    def start(self) -> None:
        self._started = True
        self._tasks = {i: asyncio.create_task(self._recv_loop(i)) for i, d in enumerate(self._dealers) if d is not None}
        if self._view is not None:
            self._renewer = asyncio.create_task(self._renew_subscriptions())

    async def _subscribe(self, idx: int, full: bool) -> None:
        assert self._view is not None
        try:
            await self._dealers[idx].send("route_sub", {"block": self._view.block, "full": full})
        except Exception as e:  # noqa: BLE001 - a closed socket: the worker is being replaced
            logger.debug("could not subscribe to inference worker %d: %s", idx, e)

    async def _renew_subscriptions(self) -> None:
        """Subscribe to every worker's routing reports now, then renew while this client lives."""
        full = True
        while not self._closing:
            for i in self.alive:
                await self._subscribe(i, full)
            full = False
            await asyncio.sleep(_RENEW_S)

    async def close(self) -> None:
        self._closing = True
        if self._renewer is not None:
            self._renewer.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = self._sweep_loop = None
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        for p in self._pending.values():
            if not p.future.done():
                p.future.set_result(None)
        self._pending.clear()

    def set_version(self, version: int) -> None:
        """A newer policy version: forget the sticky sessions (no worker holds a current-policy prefix)."""
        if version > self._version:
            if self._version >= 0 and self._sticky:
                self.stats["sticky_resets"] += 1
                self._sticky.clear()
            self._version = version

    def deadline(self, req: GenerateRequest) -> float:
        """Seconds one attempt of `req` may take: a base plus an allowance per token it may generate."""
        return self._timeout + self._per_token * max(0, int(req.gconfig.max_new_tokens))

    async def _abort(self, idx: int, wire_id: str, why: str) -> None:
        """Tell worker `idx` to stop generating `wire_id` (best effort: a lost worker may not hear it)."""
        self.stats[f"aborted_{why}"] += 1
        try:
            abort = GenAbort(qid=wire_id)
            await self._dealers[idx].send(abort.TYPE, abort.to_payload())
        except Exception as e:  # noqa: BLE001 - a closed socket: nothing left to stop
            logger.debug("could not abort request %s on worker %d: %s", wire_id, idx, e)

    def _abort_later(self, idx: int, wire_id: str, why: str) -> None:
        t = asyncio.get_running_loop().create_task(self._abort(idx, wire_id, why))
        self._aborts.add(t)
        t.add_done_callback(self._aborts.discard)

    def _sweep(self) -> None:
        """Time out the attempts past their deadline; runs every `_sweep_every` seconds while requests are pending
        (one timer per client instead of one per request)."""
        self._sweeper = self._sweep_loop = None
        if not self._pending:
            return
        now = time.monotonic()
        for p in self._pending.values():
            if p.expires <= now and not p.future.done():
                p.future.set_result(_TIMEOUT)  # wakes its generate() (no callback runs here: the dict stays as is)
        self._schedule_sweep(asyncio.get_running_loop())

    def _schedule_sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._sweeper is not None:  # scheduled on another (closed) event loop: it will never run
            self._sweeper.cancel()
        self._sweeper = loop.call_later(self._sweep_every, self._sweep)
        self._sweep_loop = loop

    def _live(self, exclude: int, policy: Optional[str]) -> list[int]:
        """The workers a request of `policy` may go to now: alive, not draining, serving it, not `exclude`."""
        placed = self._placed.get(policy) if policy is not None else None
        return [i for i, a in enumerate(self._alive)
                if a and i != exclude and i not in self._draining and (placed is None or i in placed)]

    def _choose(self, session_id: Optional[str], exclude: int = -1, hashes: Optional[Any] = None,
                policy: Optional[str] = None) -> int:
        """Sticky worker of the session if it is alive, else the live worker with the least outstanding work; with
        a view and `hashes` (the request's prefix blocks), the view's score. Only workers serving `policy`."""
        if hashes is not None and self._view is not None:
            return self._choose_by_view(session_id, exclude, hashes, policy)
        live = self._live(exclude, policy)
        if session_id is not None and session_id in self._sticky:
            idx = self._sticky[session_id]
            if idx in live:
                self._sticky.move_to_end(session_id)
                return idx
            del self._sticky[session_id]
        if not live:
            return -1
        idx = min(live, key=self._load.__getitem__)
        if session_id is not None:
            self._sticky[session_id] = idx
            if len(self._sticky) > self._max_sessions:
                self._sticky.popitem(last=False)
        return idx

    def _choose_by_view(self, session_id: Optional[str], exclude: int, hashes: Any, policy: Optional[str]) -> int:
        assert self._view is not None
        live = self._live(exclude, policy)
        if not live:
            return -1
        sticky = self._sticky.get(session_id) if session_id is not None else None
        idx, known = self._view.choose(hashes, live, self._reqs, sticky)
        self._view.routed(idx, hashes, known)
        if session_id is not None:
            self._sticky[session_id] = idx
            self._sticky.move_to_end(session_id)
            if len(self._sticky) > self._max_sessions:
                self._sticky.popitem(last=False)
        return idx

    async def _send(self, p: _Pending, idx: int) -> None:
        """Put `p` on worker `idx` (moving its load there) and send it."""
        if p.idx >= 0:
            self._load[p.idx] -= p.work
            self._reqs[p.idx] -= 1
        p.idx = idx
        p.attempts += 1
        self._load[idx] += p.work
        self._reqs[idx] += 1
        await self._dealers[idx].send("gen_req", p.wire)
        self.stats["sent"] += 1
        self.stats[f"sent_w{idx}"] += 1  # since worker idx (last) joined: routing balance, and proof of a rejoin

    async def worker_lost(self, idx: int) -> None:
        """Stop routing to worker `idx` and re-send its outstanding requests to the others (idempotent)."""
        if not 0 <= idx < len(self._dealers) or not self._alive[idx]:
            return
        self._alive[idx] = False
        self.stats["workers_lost"] += 1
        if self._view is not None:
            self._view.forget(idx)
        for sid in [s for s, i in self._sticky.items() if i == idx]:
            del self._sticky[sid]
        stranded = [p for p in self._pending.values() if p.idx == idx and not p.future.done()]
        logger.warning("inference worker %d lost: re-sending its %d outstanding requests to workers %s", idx,
                       len(stranded), self.alive)
        for p in stranded:
            target = self._choose(p.wire.session_id, hashes=self._hashes(p.wire), policy=p.wire.policy)
            if target < 0:
                p.future.set_result(GenerateResponse(qid=p.wire.qid, error="no inference worker left"))
                continue
            p.attempts -= 1  # a re-send after a loss is not the request's fault: it does not use up an attempt
            await self._send(p, target)
            self.stats["resent_lost"] += 1

    def worker_draining(self, idx: int) -> None:
        """Worker `idx` is leaving the run: route nothing new to it; its requests in flight finish there (a
        `worker_lost` once it is gone re-sends whatever did not)."""
        if not 0 <= idx < len(self._dealers) or idx in self._draining:
            return
        self._draining.add(idx)
        self.stats["workers_draining"] += 1
        for sid in [s for s, i in self._sticky.items() if i == idx]:
            del self._sticky[sid]
        if self._view is not None:
            self._view.forget(idx)

    def worker_back(self, idx: int, dealer: Any) -> None:
        """Worker `idx` was restarted (a new process, a new address), or joined the run (the next index): route
        to it (again) over `dealer`."""
        if idx < 0:
            return
        while len(self._dealers) <= idx:  # a server added to the run (ones after it may have joined first)
            self._dealers.append(None)
            self._load.append(0)
            self._reqs.append(0)
            self._alive.append(False)
            if self._view is not None:
                self._view.add_server()
        old = self._dealers[idx]
        self._dealers[idx] = dealer
        if self._started:
            if idx in self._tasks:
                self._tasks[idx].cancel()
            self._tasks[idx] = asyncio.create_task(self._recv_loop(idx))
        if old is not None and old is not dealer and hasattr(old, "close"):
            old.close()
        self._draining.discard(idx)
        self._alive[idx] = True
        self._load[idx] = sum(p.work for p in self._pending.values() if p.idx == idx)
        self._reqs[idx] = sum(1 for p in self._pending.values() if p.idx == idx)
        if self._view is not None:
            self._view.forget(idx)
            t = asyncio.get_running_loop().create_task(self._subscribe(idx, True))
            self._aborts.add(t)
            t.add_done_callback(self._aborts.discard)
        self.stats["workers_back"] += 1
        self.stats[f"back_w{idx}"] += 1
        self.stats[f"sent_w{idx}"] = 0
        self._back.set()
        self._back = asyncio.Event()
        logger.warning("inference worker %d is back; routing to workers %s", idx, self.alive)

    def _hashes(self, req: GenerateRequest) -> Optional[Any]:
        """The request's prefix blocks when the view chooses (several workers alive), else None."""
        if self._view is None or sum(self._alive) < 2:
            return None
        return prefix_hashes(req.input_ids, self._view.block)

    async def _wait_for_a_worker(self, session_id: Optional[str], timeout: float, hashes: Optional[Any] = None,
                                 policy: Optional[str] = None) -> int:
        """The worker to send to once one is back (`worker_back`), or -1 after `timeout` seconds."""
        self.stats["waited_for_worker"] += 1
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while (idx := self._choose(session_id, hashes=hashes, policy=policy)) < 0 and not self._closing:
            try:
                await asyncio.wait_for(self._back.wait(), max(0.0, end - loop.time()))
            except asyncio.TimeoutError:
                return -1
        return idx

    async def generate(self, req: GenerateRequest, info: Optional[dict] = None) -> GenerateResponse:
        """The response to `req`; `info`, when given, gets the index of the worker that answered ("worker", -1
        if none did) and the number of sends ("attempts"), for trajectory traces."""
        wire_id = f"{next(self._ids)}"
        loop = asyncio.get_running_loop()
        # `req` under the wire id, without a second __post_init__ (its input_ids were converted when it was built)
        wire = object.__new__(GenerateRequest)
        wire.__dict__.update(req.__dict__, qid=wire_id)
        g = req.gconfig
        p = _Pending(loop.create_future(), wire, g.n * g.max_new_tokens)
        deadline = self._timeout + self._per_token * max(0, int(g.max_new_tokens))  # self.deadline(req), inlined
        hashes = self._hashes(req)
        idx = self._choose(req.session_id, hashes=hashes, policy=req.policy)
        if idx < 0:  # every worker is lost: one may be restarting (the controller's worker_back), wait that long
            idx = await self._wait_for_a_worker(req.session_id, deadline, hashes, req.policy)
            if idx < 0:
                return GenerateResponse(qid=req.qid, error=f"no inference worker left (none came back in "
                                                           f"{deadline:.0f}s)")
        self._pending[wire_id] = p
        try:
            await self._send(p, idx)
            while True:
                # _sweep resolves the attempt's future with _TIMEOUT once it expires (not wait_for + shield: three
                # futures and their callbacks per request; not a loop timer each: heap upkeep per request)
                p.expires = time.monotonic() + deadline
                if self._sweep_loop is not loop:
                    self._schedule_sweep(loop)
                resp = await p.future
                if resp is not _TIMEOUT:
                    break
                target = self._choose(req.session_id, exclude=p.idx, hashes=hashes, policy=req.policy)
                if p.attempts < self._max_attempts and target >= 0:
                    logger.warning("request %s: no answer from inference worker %d in %.0fs; aborting it there and "
                                   "re-sending to %d", wire_id, p.idx, deadline, target)
                    self.stats["resent_timeout"] += 1
                    await self._abort(p.idx, wire_id, "resent")  # no double work (its answer would be late anyway)
                    p.future = loop.create_future()  # the next attempt's; a late answer to the first still counts
                    await self._send(p, target)
                    continue
                self.stats["timeout"] += 1
                return GenerateResponse(qid=req.qid,
                                        error=f"no response from inference worker {p.idx} in {deadline:.0f}s")
        finally:
            if self._pending.pop(wire_id, None) is not None and p.idx >= 0:
                self._load[p.idx] -= p.work
                self._reqs[p.idx] -= 1
                if not self._closing:  # given up (out of attempts, or the caller was cancelled): stop it there
                    self._abort_later(p.idx, wire_id, "abandoned")
            if info is not None:
                info["worker"], info["attempts"] = p.answered_by, p.attempts
        if resp is None:
            return GenerateResponse(qid=req.qid, error="inference client closed")
        resp.qid = req.qid
        return resp

    def _observe_versions(self, resp: GenerateResponse) -> None:
        # A sample's versions never decrease (weights only move forward), so its last token has its newest.
        # (a plain loop, and set_version only when newer: this runs once per answer)
        newest = -1
        for s in resp.samples:
            versions = s.output_versions
            if len(versions) and versions[-1] > newest:
                newest = int(versions[-1])
        if newest > self._version:
            self.set_version(newest)

    async def _recv_loop(self, idx: int) -> None:
        dealer = self._dealers[idx]
        while True:
            msg_type, resp = await dealer.recv()
            if msg_type == "route_stats":
                if self._view is not None and not self._view.report(idx, resp, self._reqs[idx]):
                    await self._subscribe(idx, True)  # a report was missed: the whole summary again
                continue
            if msg_type != "gen_resp":
                self.stats["unexpected"] += 1
                continue
            p = self._pending.get(resp.qid)
            if p is None or p.future.done():
                self.stats["late"] += 1  # timed out already, or a duplicate after a re-send
                continue
            del self._pending[resp.qid]
            self._load[p.idx] -= p.work
            self._reqs[p.idx] -= 1
            if p.idx != idx:  # an earlier attempt answered first: stop the re-sent one (no double work)
                self._abort_later(p.idx, resp.qid, "superseded")
            p.idx = -1
            p.answered_by = idx
            if p.wire.policy is None:  # the run's own versions (a named policy counts its own)
                self._observe_versions(resp)
            p.future.set_result(resp)
            self.stats["received"] += 1
