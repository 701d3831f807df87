"""Prefix block hashes and a block-granular LRU of cached prefixes: the one language the inference servers and the
rollout workers' routers speak about what a server has cached.

Why these hashes: a router must compare a request's token ids with what a server holds without the server sending
its token ids. Both sides cut the ids into blocks of ``block`` tokens and name the prefix that ends at each block by
one 64-bit number, the same in every process (no Python ``hash``: its salt differs between processes for bytes).
The hash of prefix k is a position-keyed sum, computed for all k in one vectorised pass (a request of 32k tokens
costs a few microseconds, not a Python loop per block):

    digest_k = sum_j ids[k*block + j] * W_j                       (W: fixed random odd uint64, one per column)
    H_k      = sum_{m <= k} (digest_m + 1) * R_m   (mod 2**64)   (R: fixed random odd uint64, one per block depth)

Two different prefixes share H_k with probability ~2**-64; a router that is wrong on a collision only routes one
request to a server without the prefix (a cache miss), never a wrong answer: each engine matches the ids itself.

``BlockLRU``: the prefixes a server holds, as the hashes of their blocks, least recently used evicted past a block
budget. Prefix property: a cached block's shorter prefixes are cached too (they are touched deepest-first, so the
shallow ones are the most recent and evicted last), which lets ``match`` find the deepest cached block by binary
search. With ``track=True`` it records what was added and dropped since the last ``take_delta`` (what a server
publishes to the routers).
"""

from __future__ import annotations

import collections
from typing import Iterable, Optional, Sequence

import numpy as np

_SEED = 0x5EED_B10C
_W_CACHE: dict[int, np.ndarray] = {}
_R = np.zeros(0, np.uint64)


def _columns(block: int) -> np.ndarray:
    w = _W_CACHE.get(block)
    if w is None:
        w = np.random.default_rng([_SEED, block]).integers(0, 1 << 63, size=block, dtype=np.uint64) * np.uint64(2) \
            + np.uint64(1)
        _W_CACHE[block] = w
    return w


def _depths(k: int) -> np.ndarray:
    """R_0 .. R_{k-1} (grown in fixed chunks, each from its own seed, so every process draws the same)."""
    global _R
    while len(_R) < k:
        chunk = len(_R) // 4096
        more = np.random.default_rng([_SEED, 1, chunk]).integers(0, 1 << 63, size=4096, dtype=np.uint64)
        _R = np.concatenate([_R, more * np.uint64(2) + np.uint64(1)])
    return _R[:k]


def prefix_hashes(ids: Sequence[int] | np.ndarray, block: int, known: Optional[np.ndarray] = None) -> np.ndarray:
    """H_0 .. H_{K-1} of the K whole blocks of `ids` (uint64; empty when `ids` is shorter than one block).

    `known`: the hashes of a sequence `ids` starts with (a prompt, for the prompt + its answer): those blocks are
    taken as they are and only the ones after them are hashed (the caller vouches for the prefix)."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    a = np.asarray(ids)
    k = len(a) // block
    s = 0 if known is None else min(len(known), k)
    if k == s:
        return known[:k] if known is not None else np.zeros(0, np.uint64)
    blocks = a[s * block:k * block].astype(np.uint64).reshape(k - s, block)
    digest = blocks.dot(_columns(block)) + np.uint64(1)  # uint64 arrays wrap silently (mod 2**64)
    tail = np.cumsum(digest * _depths(k)[s:], dtype=np.uint64)
    if not s:
        return tail
    tail += known[s - 1]  # H_m = H_{s-1} + sum over the new blocks (the sums chain)
    return np.concatenate([known[:s], tail])


def as_hashes(raw: bytes | np.ndarray | Iterable[int]) -> np.ndarray:
    """Hashes as sent on the wire (raw uint64 bytes) or any sequence of them, as a uint64 array."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return np.frombuffer(raw, np.uint64)
    return np.asarray(list(raw) if not isinstance(raw, np.ndarray) else raw, np.uint64)


class BlockLRU:
    """Cached prefixes as block hashes, at most `max_blocks` of them, least recently used first out."""

    def __init__(self, max_blocks: int, track: bool = False) -> None:
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        self.max_blocks = int(max_blocks)
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._track = track
        self._added: set[int] = set()
        self._dropped: set[int] = set()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: int) -> bool:
        return h in self._lru

    @property
    def changed(self) -> bool:
        """Whether blocks were added or dropped since the last `take_delta` (tracking only)."""
        return bool(self._added or self._dropped)

    def hashes(self) -> np.ndarray:
        return np.fromiter(self._lru, np.uint64, len(self._lru))

    def match(self, hashes: np.ndarray) -> int:
        """How many leading blocks of `hashes` are cached (binary search on the prefix property)."""
        lru = self._lru
        lo, hi = 0, len(hashes)  # blocks [0, lo) cached; the answer is in [lo, hi]
        if hi == 0 or int(hashes[0]) not in lru:
            return 0
        if int(hashes[-1]) in lru:
            return hi
        lo, hi = 1, hi - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if int(hashes[mid - 1]) in lru:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def touch(self, hashes: np.ndarray) -> int:
        """Cache every prefix in `hashes` (a sequence's blocks, shallow first) and make them the most recent, the
        shallowest last; returns how many blocks were new."""
        if self.max_blocks == 0 or len(hashes) == 0:
            return 0
        lru = self._lru
        new = 0
        for h in reversed(hashes[:self.max_blocks].tolist()):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                new += 1
                if self._track:
                    if h in self._dropped:
                        self._dropped.discard(h)
                    else:
                        self._added.add(h)
        while len(lru) > self.max_blocks:
            self._drop(lru.popitem(last=False)[0])
            self.evicted += 1
        return new

    def _drop(self, h: int) -> None:
        if self._track:
            if h in self._added:
                self._added.discard(h)
            else:
                self._dropped.add(h)

    def clear(self) -> None:
        if self._track:
            for h in self._lru:
                self._drop(h)
        self._lru.clear()

    def take_delta(self) -> tuple[np.ndarray, np.ndarray]:
        """(added, dropped) since the last call, as uint64 arrays."""
        added = np.fromiter(self._added, np.uint64, len(self._added))
        dropped = np.fromiter(self._dropped, np.uint64, len(self._dropped))
        self._added.clear()
        self._dropped.clear()
        return added, dropped

