"""An inference server's reports to the rollout workers' routers (the server side of `arl.rollout.routing`).

Why reports and not a central router: every rollout worker routes its own requests (no extra hop, no single point
of failure), and each needs what only the servers know: how many requests every worker has put on a server, and
which prefixes it has cached. So each server publishes, every ``publish_interval_s``, its requests and requested
tokens in flight and the change of its cached prefixes since the last report (block hashes added and dropped,
`arl.utils.prefix_hash`), to every rollout worker that subscribed (a ``route_sub`` on its request DEALER, renewed
while it lives). A new subscriber, or one that missed a report (sequence gap), gets the whole summary once.

What "cached" means here: the prefixes this server served (each request's prompt from its arrival, its sequences
once answered), least recently used forgotten past the engine's cache size, all forgotten when new weights load,
which is what the torch engine's prefix cache, the sim engine's model and SGLang's radix cache hold. It is the
server's own record of its traffic, not a read of the engine's memory: exact for the sim engine (same rule, same
size), an estimate for the torch engine (it keeps only finished sequences) and off for SGLang (its cache size is
not known here; set ``inference.routing.cache_tokens`` to report one). SGLang exposes its cache only as counters
(``cached_tokens`` per request, hit rate in ``/metrics``); a server with no summary is routed by load + sticky.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Callable, Optional

import numpy as np

from arl.api.types import GenerateRequest, GenerateResponse
from arl.utils.prefix_hash import BlockLRU, prefix_hashes

logger = logging.getLogger("arl.inference")

SUBSCRIPTION_S = 30.0  # a subscriber that has not renewed in this long is forgotten (its worker is gone)


class RoutingFeed:
    """The load and prefix-cache summary one server publishes to its subscribers.

    Args:
        index: the server's index (named in every report).
        send: ``send(identities, msg_type, payload)``: one message to each of those peers, without waiting (the
            server's Router ``send_each``).
        block_tokens: tokens per hashed block (must equal the subscribers'; a mismatch is refused, named).
        cache_tokens: tokens of served prefixes reported as cached; 0: load only.
    """

    def __init__(self, *, index: int, send: Callable[[list[bytes], str, Any], None], block_tokens: int,
                 cache_tokens: int, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self._send = send
        self.block = int(block_tokens)
        self.cache: Optional[BlockLRU] = BlockLRU(cache_tokens // self.block, track=True) \
            if cache_tokens >= self.block else None
        self.interval_s = interval_s
        self._clock = clock
        self.epoch = secrets.randbits(62)  # a restarted server starts a new sequence
        self.seq = 0
        self.reqs = 0  # requests in flight (all clients)
        self.work = 0  # their requested new tokens
        self._flushes = 0  # weight loads so far: a sequence started before the last one is not cached
        self._subs: dict[bytes, float] = {}  # subscriber identity -> when it last renewed
        self._last_load = (-1, -1)  # (reqs, work) of the last report
        self.stats = {"route_reports": 0, "route_full": 0, "route_sub_refused": 0}

    # ------------------------------------------------------------------ what the server tells it

    def request_started(self, req: GenerateRequest) -> tuple[int, Optional[np.ndarray]]:
        """A request arrived; returns the token to give `request_done` (its flush epoch and its prompt's hashes)."""
        self.reqs += 1
        self.work += req.gconfig.n * req.gconfig.max_new_tokens
        hashes = None
        if self.cache is not None:
            hashes = prefix_hashes(req.input_ids, self.block)
            self.cache.touch(hashes)
        return self._flushes, hashes

    def request_done(self, req: GenerateRequest, resp: Optional[GenerateResponse],
                     token: tuple[int, Optional[np.ndarray]]) -> None:
        self.reqs -= 1
        self.work -= req.gconfig.n * req.gconfig.max_new_tokens
        epoch, prompt = token
        if self.cache is None or resp is None or epoch != self._flushes:
            return
        for s in resp.samples:  # the prompt's blocks hashed at its arrival: only the answer's are new
            if len(s.output_ids):
                self.cache.touch(prefix_hashes(np.concatenate([req.input_ids, s.output_ids]), self.block, prompt))

    def weights_loaded(self) -> None:
        """New weights: nothing cached is reused (the engines flush), and subscribers learn it with one empty
        summary instead of every block dropped."""
        self._flushes += 1
        if self.cache is not None and len(self.cache):
            self.cache.clear()
            self.cache.take_delta()
            self._publish(full=True)

    def subscribe(self, ident: bytes, payload: Any) -> None:
        """A router subscribes (or renews); it gets the whole summary when it asks (`full`) or is new."""
        block = payload.get("block") if isinstance(payload, dict) else None
        if block != self.block:
            self.stats["route_sub_refused"] += 1
            logger.warning("inference%d: refused a routing subscription with block_tokens=%r (this server: %d); "
                           "every role must run with the same inference.routing", self.index, block, self.block)
            return
        new = ident not in self._subs
        self._subs[ident] = self._clock()
        if new or payload.get("full"):
            self._send([ident], "route_stats", self._report(full=True))
            if len(self._subs) == 1 and self.cache is not None:
                self.cache.take_delta()  # the summary holds it all, and nobody else waits for the change

    # ------------------------------------------------------------------ publishing

    def _report(self, full: bool) -> dict:
        if full:
            self.stats["route_full"] += 1
            added = self.cache.hashes() if self.cache is not None else np.zeros(0, np.uint64)
            dropped = np.zeros(0, np.uint64)
        else:
            self.seq += 1
            added, dropped = self.cache.take_delta() if self.cache is not None else (np.zeros(0, np.uint64),) * 2
        return {"i": self.index, "epoch": self.epoch, "seq": self.seq, "full": full, "reqs": self.reqs,
                "work": self.work, "block": self.block, "cache": self.cache is not None,
                "add": added.tobytes(), "drop": dropped.tobytes()}

    def _publish(self, full: bool = False) -> None:
        now = self._clock()
        for ident in [i for i, t in self._subs.items() if now - t > SUBSCRIPTION_S]:
            del self._subs[ident]
        if not self._subs:
            if self.cache is not None:
                self.cache.take_delta()  # nobody to tell: a subscriber starts from a whole summary
            return
        if not full and self.reqs == self._last_load[0] and self.work == self._last_load[1] and \
                (self.cache is None or not self.cache.changed):
            return  # nothing new (the sequence numbers continue with the next report)
        self._last_load = (self.reqs, self.work)
        self._send(list(self._subs), "route_stats", self._report(full))
        self.stats["route_reports"] += 1

    async def run(self) -> None:
        """Publish every interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - a report lost is a routing estimate off, never a server down
                logger.exception("inference%d: routing report failed", self.index)
