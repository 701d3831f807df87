"""The torch engine's prefix KV cache: the KV of finished sequences, so a request that extends one (the next turn
of a multi-turn chat: history + answer + feedback) prefills only its new suffix.

Why it is built this way:

* **Matched by token ids, not by session.** A request reuses the longest cached prefix of its own token ids,
  whatever its session id says, so a client that rebuilds its history the same way gets the same reuse, and one
  whose history changed (re-tokenised, edited) cannot get a wrong KV. Lookup hashes the ids in blocks of
  `BLOCK` tokens (each block's hash chains the previous one's, as vLLM's block hashes do), finds the deepest
  block some entry shares, and then compares the ids themselves (so a hash collision costs a miss, never a wrong
  KV) to extend the match inside the next block. A match shorter than one block is not worth a lookup.
* **One version of the weights.** The engine clears the cache at every weight update, and stores only sequences
  whose whole KV was computed under the weights now loaded (a row that lived through an update carries KV of two
  versions); a KV from old weights is never reused.
* **Bounded by tokens, least recently used first.** The sequences that finish in one engine step are copied out
  of the batch together (one gather per layer, not one copy per sequence: per-sequence copies cost as much as the
  prefill they save on a small model), packed end to end without padding, into a `Storage` their entries view;
  the budget counts every storage's whole size for as long as one of its entries lives, so what the cache holds
  in memory never exceeds it. A storage larger than the budget is never admitted (it would evict every entry,
  then itself): the engine packs a step's sequences into storages of at most the budget each. An
  entry whose ids are a prefix of another's is dominated (every lookup matches the longer one at least as far),
  so it is dropped when its extension is stored, and a dominated newcomer is not stored at all.
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

import torch

BLOCK = 4  # tokens per hashed block (the default run's prompts are ~8 tokens)
_CANDIDATES = 4  # entries compared token by token past the deepest shared block (the newest first)

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values, each [1, heads, tokens, head_dim]


class Storage:
    """The tensors some entries' KV are views of, `tokens` in size (rows x columns), while `live` entries use it."""

    __slots__ = ("tokens", "live")

    def __init__(self, tokens: int) -> None:
        self.tokens = int(tokens)
        self.live = 0


class Entry:
    """One cached sequence: its token ids, its per-layer KV, the block hashes it is indexed under and the storage
    its KV views."""

    __slots__ = ("ids", "kv", "hashes", "storage")

    def __init__(self, ids: tuple[int, ...], kv: KV, hashes: list[int], storage: Storage) -> None:
        self.ids = ids
        self.kv = kv
        self.hashes = hashes
        self.storage = storage

    def __len__(self) -> int:
        return len(self.ids)


def block_hashes(ids: Sequence[int], limit: int) -> list[int]:
    """The chained hash of every whole block of `ids[:limit]`."""
    out: list[int] = []
    h = 0
    for k in range(min(limit, len(ids)) // BLOCK):
        h = hash((h, *ids[k * BLOCK:(k + 1) * BLOCK]))
        out.append(h)
    return out


class PrefixCache:
    """Finished sequences' KV under the current weights, least recently used evicted past `max_tokens`."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # id(entry) -> entry, LRU
        self._index: dict[int, dict[int, Entry]] = {}  # block hash -> entries holding that prefix (insertion order)
        self.tokens = 0  # the size of every storage an entry uses
        self.stats = dict.fromkeys(("prefix_lookups", "prefix_hits", "prefix_hit_tokens", "prefix_stored",
                                    "prefix_evicted", "prefix_cleared"), 0)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[int], limit: int) -> tuple[Optional[Entry], int]:
        """The entry sharing the longest prefix with `ids`, and that prefix's length (at most `limit`); (None, 0)
        when none shares a whole block. The entry becomes the most recently used."""
        entry, n = self._longest(ids, limit)
        self.stats["prefix_lookups"] += 1
        if entry is not None:
            self._entries.move_to_end(id(entry))
            self.stats["prefix_hits"] += 1
            self.stats["prefix_hit_tokens"] += n
        return entry, n

    def _longest(self, ids: Sequence[int], limit: int,
                 hashes: Optional[list[int]] = None) -> tuple[Optional[Entry], int]:
        limit = min(limit, len(ids))
        candidates: Optional[dict[int, Entry]] = None
        depth = 0
        for k, h in enumerate(block_hashes(ids, limit) if hashes is None else hashes[:limit // BLOCK]):
            found = self._index.get(h)
            if found is None:
                break
            candidates, depth = found, (k + 1) * BLOCK
        if candidates is None:
            return None, 0
        best: Optional[Entry] = None
        best_n = 0
        for i, entry in enumerate(reversed(candidates.values())):
            if i == _CANDIDATES:
                break
            if entry.ids[:depth] != tuple(ids[:depth]):  # a hash collision
                continue
            n = depth
            end = min(limit, len(entry))
            while n < end and entry.ids[n] == ids[n]:
                n += 1
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    def covers(self, ids: Sequence[int]) -> bool:
        """Whether `ids` would not be stored: an entry holds them all already, or they exceed the whole budget."""
        if not 0 < len(ids) <= self.max_tokens:
            return True
        covering, n = self._longest(ids, len(ids))
        return covering is not None and n == len(ids)

    def insert(self, ids: Sequence[int], kv: KV, replaces: Optional[Entry] = None,
               storage: Optional[Storage] = None) -> bool:
        """Store `ids` with their `kv` (per layer [1, heads, len(ids), head_dim] tensors the cache may keep; views
        of `storage`, which the budget counts whole; None: they are their own storage of len(ids) tokens), unless
        an entry already covers them or they (or their storage) exceed the budget; drop `replaces` (the entry the
        sequence was prefilled from) when `ids` extend it. Returns whether they were stored."""
        if not 0 < len(ids) <= self.max_tokens or (storage is not None and storage.tokens > self.max_tokens):
            return False  # what would not fit the budget alone would evict every entry, then itself
        ids = tuple(ids)  # a tuple of ints: not tracked by the garbage collector
        hashes = block_hashes(ids, len(ids))
        covering, n = self._longest(ids, len(ids), hashes)
        if covering is not None and n == len(ids):
            self._entries.move_to_end(id(covering))
            return False
        if replaces is not None and id(replaces) in self._entries and len(replaces) <= len(ids) \
                and ids[:len(replaces)] == replaces.ids:
            self._remove(replaces)
        entry = Entry(ids, kv, hashes, storage if storage is not None else Storage(len(ids)))
        self._entries[id(entry)] = entry
        for h in entry.hashes:
            self._index.setdefault(h, {})[id(entry)] = entry
        if entry.storage.live == 0:
            self.tokens += entry.storage.tokens
        entry.storage.live += 1
        self.stats["prefix_stored"] += 1
        while self.tokens > self.max_tokens:
            self._remove(next(iter(self._entries.values())))
            self.stats["prefix_evicted"] += 1
        return True

    def clear(self) -> None:
        """Forget every entry (the weights changed)."""
        if self._entries:
            self.stats["prefix_cleared"] += 1
        for entry in self._entries.values():
            entry.storage.live = 0
        self._entries.clear()
        self._index.clear()
        self.tokens = 0

    def _remove(self, entry: Entry) -> None:
        del self._entries[id(entry)]
        for h in entry.hashes:
            holders = self._index[h]
            del holders[id(entry)]
            if not holders:
                del self._index[h]
        entry.storage.live -= 1
        if entry.storage.live == 0:
            self.tokens -= entry.storage.tokens
