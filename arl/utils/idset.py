"""A set of ids that end in a counter, at one bit per id.

The learner remembers every group id it received and trained, for exactly-once accounting over the whole run and
across resumes. As strings that cost ~100 bytes a group (two sets), which a run of days turns into hundreds of MB
and a checkpoint that grows with every step. Group ids are a prefix per rollout-worker process and a counter
(`w0.3fa9c1g17`), so the set is kept as a bitmap per prefix: exact, 8 groups a byte.
"""

from __future__ import annotations

import base64
import re
import zlib
from typing import Any, Iterable, Iterator, Union

# a counter without leading zeros ("g007" and "g7" are different ids, so only canonical numbers go in a bitmap)
_TAIL = re.compile(r"(.*?)(0|[1-9][0-9]{0,8})")


class CounterIdSet:
    """Set of string ids; ids ending in a counter below `max_counter` are bits of their prefix's bitmap, any other
    id is kept as a string."""

    def __init__(self, ids: Iterable[str] = (), max_counter: int = 1 << 24) -> None:
        self._bits: dict[str, bytearray] = {}
        self._count: dict[str, int] = {}  # ids in each prefix's bitmap
        self._other: set[str] = set()
        self._len = 0
        self.max_counter = max_counter  # a bitmap is at most max_counter / 8 bytes (2 MiB)
        self.update(ids)

    def _room(self, prefix: str) -> int:
        """How far `prefix`'s bitmap may reach: 64 counter values per id it holds, plus 8,192. A worker's counters
        are dense (most of its groups reach the learner), so its bitmap keeps up; scattered large counters (a
        peer's bug, a fuzzer) stay strings, as many as were sent, instead of a bitmap each."""
        return 8192 + 64 * self._count.get(prefix, 0)

    def _split(self, id_: str) -> Union[tuple[str, int], None]:
        m = _TAIL.fullmatch(id_)
        if m is None:
            return None
        n = int(m.group(2))
        return (m.group(1), n) if n < self.max_counter else None

    def __contains__(self, id_: object) -> bool:
        if not isinstance(id_, str):
            return False
        key = self._split(id_)
        if key is None:
            return id_ in self._other
        bits = self._bits.get(key[0])
        byte, bit = divmod(key[1], 8)
        return (bits is not None and byte < len(bits) and bool(bits[byte] >> bit & 1)) or id_ in self._other

    def add(self, id_: str) -> bool:
        """Add `id_`; True if it was not in the set."""
        if id_ in self:
            return False
        key = self._split(id_)
        bits = self._bits.get(key[0]) if key is not None else None
        if key is None or (key[1] >= self._room(key[0]) and (bits is None or key[1] >= 8 * len(bits))):
            self._other.add(id_)
        else:
            prefix, n = key
            bits = self._bits.setdefault(prefix, bytearray())
            byte, bit = divmod(n, 8)
            if byte >= len(bits):
                bits.extend(bytes(max(byte + 1 - len(bits), len(bits))))  # doubling: amortised O(1) per id
            bits[byte] |= 1 << bit
            self._count[prefix] = self._count.get(prefix, 0) + 1
        self._len += 1
        return True

    def update(self, ids: Iterable[str]) -> None:
        for i in ids:
            self.add(str(i))

    def intersection(self, ids: Iterable[str]) -> set[str]:
        return {i for i in ids if i in self}

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[str]:
        for prefix, bits in self._bits.items():
            for byte, v in enumerate(bits):
                for bit in range(8):
                    if v >> bit & 1:
                        yield f"{prefix}{byte * 8 + bit}"
        yield from self._other

    def nbytes(self) -> int:
        """Bytes of the bitmaps (what grows with the run: 1 bit a counter value up to the largest)."""
        return sum(len(b) for b in self._bits.values())

    def to_state(self) -> dict[str, Any]:
        """JSON-safe form for a checkpoint: each bitmap zlib-compressed, base64."""
        return {"bits": {p: base64.b64encode(zlib.compress(bytes(b.rstrip(b"\0")))).decode("ascii")
                         for p, b in sorted(self._bits.items())},
                "other": sorted(self._other)}

    @classmethod
    def from_state(cls, state: Union[dict, list, None]) -> "CounterIdSet":
        """The set `to_state` wrote, or (checkpoints before this form) a plain list of ids."""
        out = cls()
        if isinstance(state, dict):
            for prefix, blob in dict(state.get("bits") or {}).items():
                bits = bytearray(zlib.decompress(base64.b64decode(blob)))
                out._bits[str(prefix)] = bits
                out._count[str(prefix)] = n = sum(bin(v).count("1") for v in bits)
                out._len += n
            out.update(state.get("other") or [])
        elif state:
            out.update(state)
        return out
