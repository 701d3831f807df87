"""One routing view for every rollout worker: each server's load and cached prefixes, from its own reports.

Each inference server publishes its requests in flight (from every rollout worker) and the change of its cached
prefix blocks every ``inference.routing.publish_interval_s`` (`arl.inference.routing_feed`); every rollout
worker's `InferenceClient` keeps them here and scores the live servers for each request with the same rule:

    score(s) = block_tokens * cached_blocks(s, request)  -  load_weight * (requests(s) - min over servers)

the first term the prefill tokens a hit on `s` saves, the second what its queue costs (``load_weight``: prefill
tokens one request in flight is worth). ``requests(s)`` is the server's last report of the other workers'
requests plus this worker's own now (so a burst of this worker's requests does not all go to one server before
the next report). The highest score wins; ties go to the least loaded. A session stays on the server that served
it before (its history is cached there) unless that server carries ``sticky_slack`` or more requests more than the
least loaded one; then the score decides, and a server that still holds the history scores high anyway.

What a request has just been sent to a server counts as cached there for ``pending_s`` seconds (the server reports
it once it arrives): the chats of one group, which start together with the same prompt, go where the first went
instead of prefilling the prompt once per server. A server that has not reported yet, or reports load only (no
cache summary: SGLang by default), scores by load alone.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from arl.utils.prefix_hash import as_hashes

logger = logging.getLogger("arl.rollout")


class RoutingView:
    """What this rollout worker knows of every server's load and cache (see the module doc)."""

    def __init__(self, num_servers: int, *, block_tokens: int, load_weight: float = 256.0, sticky_slack: int = 8,
                 pending_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.block = int(block_tokens)
        self.load_weight = float(load_weight)
        self.sticky_slack = int(sticky_slack)
        self.pending_s = float(pending_s)
        self._clock = clock
        self._held: list[set[int]] = []
        self._pending: list[dict[int, float]] = []  # hash -> when a request with that prefix was sent there
        self._epoch: list[Optional[int]] = []
        self._seq: list[int] = []
        self._others: list[int] = []  # requests in flight there from other workers, at its last report
        self.stats: collections.Counter = collections.Counter()
        for _ in range(num_servers):
            self.add_server()

    def add_server(self) -> int:
        self._held.append(set())
        self._pending.append({})
        self._epoch.append(None)
        self._seq.append(0)
        self._others.append(0)
        return len(self._held) - 1

    def forget(self, idx: int) -> None:
        """Server `idx` is gone or restarted: nothing is known of it until it reports again."""
        self._held[idx] = set()
        self._pending[idx] = {}
        self._epoch[idx] = None
        self._others[idx] = 0

    def cached_blocks(self, idx: int) -> int:
        return len(self._held[idx])

    # ------------------------------------------------------------------ reports

    def report(self, idx: int, payload: Any, own_requests: int) -> bool:
        """Apply server `idx`'s report; False when this view needs its whole summary again (a missed report, a
        restarted server), which the caller asks for with a `route_sub` of ``full=True``."""
        if not isinstance(payload, dict) or payload.get("i") != idx or payload.get("block") != self.block:
            self.stats["route_bad_reports"] += 1
            return True
        try:
            epoch, seq, reqs = int(payload["epoch"]), int(payload["seq"]), int(payload["reqs"])
            added, dropped = as_hashes(payload["add"]), as_hashes(payload["drop"])
        except (KeyError, TypeError, ValueError):
            self.stats["route_bad_reports"] += 1
            return True
        if payload.get("full"):
            self._held[idx] = set(added.tolist())
            self.stats["route_full"] += 1
        elif epoch != self._epoch[idx] or seq != self._seq[idx] + 1:
            self.stats["route_gaps"] += 1
            return False
        else:
            held = self._held[idx]
            held.update(added.tolist())
            held.difference_update(dropped.tolist())
        self._epoch[idx], self._seq[idx] = epoch, seq
        self._others[idx] = max(0, reqs - own_requests)
        pending = self._pending[idx]
        if pending:
            old = self._clock() - self.pending_s
            self._pending[idx] = {h: t for h, t in pending.items() if t > old}
        self.stats["route_reports"] += 1
        return True

    # ------------------------------------------------------------------ choosing

    def _depth(self, idx: int, hashes: Sequence[int], now: float) -> int:
        """Leading blocks of `hashes` cached (or just sent) on server `idx` (binary search: a cached block's
        shorter prefixes are cached too)."""
        held, pending, old = self._held[idx], self._pending[idx], now - self.pending_s

        def has(h: int) -> bool:
            return h in held or pending.get(h, old) > old

        n = len(hashes)
        if n == 0 or not has(hashes[0]):
            return 0
        if has(hashes[-1]):
            return n
        lo, hi = 1, n - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if has(hashes[mid - 1]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def choose(self, hashes: np.ndarray, live: Sequence[int], own_requests: Sequence[int],
               sticky: Optional[int] = None) -> tuple[int, int]:
        """(server, its cached blocks of the request) for a request whose prefix blocks are `hashes`, among
        `live` (non-empty); `sticky`: the session's previous server, if any."""
        loads = {i: self._others[i] + own_requests[i] for i in live}
        least = min(loads.values())
        now = self._clock()
        hs = hashes.tolist()
        if sticky is not None and sticky in loads and loads[sticky] < least + self.sticky_slack:
            self.stats["route_sticky"] += 1
            return sticky, -1
        best, best_key, best_depth = -1, None, 0
        top = self.block * len(hs)  # the most a cache can save this request
        for i in sorted(live, key=loads.__getitem__):  # least loaded first: stop once none can score higher
            penalty = self.load_weight * (loads[i] - least)
            if best_key is not None and top - penalty < best_key[0]:
                break
            depth = self._depth(i, hs, now)
            key = (self.block * depth - penalty, -loads[i])
            if best_key is None or key > best_key:
                best, best_key, best_depth = i, key, depth
        self.stats["route_scored"] += 1
        if best_depth:
            self.stats["route_cache_choice"] += 1
        return best, best_depth

    def routed(self, idx: int, hashes: np.ndarray, known: int) -> None:
        """A request whose prefix blocks are `hashes` was sent to `idx`, which held the first `known` of them
        (-1: unknown, not looked up): count the rest as cached there until its report says so."""
        if known < 0:
            return
        if known < len(hashes):
            now = self._clock()
            pending = self._pending[idx]
            for h in hashes[known:].tolist():
                pending[h] = now
