"""Replay protection for signed frames: a stamp (sender id, sequence number) inside each frame's HMAC.

An HMAC alone lets anyone who captured a frame send it again (a ``traj`` trained twice, a ``register`` that moves a
role's identity to the replayer). So with a secret every frame carries, under its tag, a 24-byte stamp: the sending
socket's random 16-byte id and a 64-bit sequence number, and every receiving socket remembers the newest number per
sender id and refuses anything not newer (`ReplayGuard`). zmq keeps one socket's frames to one peer in order, so a
legitimate frame is never refused.

The sequence number is a clock: ``max(previous + 1, now in microseconds)``, so a receiver can refuse a frame from a
sender it has never heard that was stamped long ago (`FRESH_WINDOW_S`): frames captured from an earlier incarnation
of a run (same secret) cannot be replayed to the new one's fresh sockets. Hosts' clocks must agree within that
window (NTP does far better).

Cost per frame: one ``time.time_ns()`` and a 24-byte concatenation to send; a slice, a dict lookup and a
comparison to receive.
"""

from __future__ import annotations

import os
import time
from typing import Optional

__all__ = ["STAMP_SIZE", "FRESH_WINDOW_S", "Stamper", "ReplayGuard", "fresh_stamp"]

STAMP_SIZE = 24  # 16-byte sender id + 8-byte little-endian sequence number
_ID = 16
FRESH_WINDOW_S = 600.0


class Stamper:
    """One sending socket's stamps: its id, and a sequence number that only goes up (and follows the clock)."""

    __slots__ = ("sender", "_last")

    def __init__(self, sender: Optional[bytes] = None) -> None:
        self.sender = sender if sender is not None else os.urandom(_ID)
        self._last = 0

    def __call__(self) -> bytes:
        seq = time.time_ns() // 1000
        if seq <= self._last:
            seq = self._last + 1
        self._last = seq
        return self.sender + seq.to_bytes(8, "little")


def fresh_stamp() -> bytes:
    """A stamp for a frame built outside a socket (a sender of its own, used once)."""
    return Stamper()()


class ReplayGuard:
    """One receiving socket's memory: the newest sequence number from each sender id (`check` says why a frame
    is refused: not newer, or too old from an unknown sender). Only authenticated frames reach it (the HMAC is
    checked first), so its size is bounded by the run's own sockets."""

    __slots__ = ("_last", "window_us")

    def __init__(self, window_s: float = FRESH_WINDOW_S) -> None:
        self._last: dict[bytes, int] = {}
        self.window_us = int(window_s * 1e6)

    def check(self, stamp: bytes) -> Optional[str]:
        """None (and the stamp is remembered) for a fresh frame, else why it is refused."""
        sender = stamp[:_ID]
        seq = int.from_bytes(stamp[_ID:], "little")
        last = self._last.get(sender)
        if last is None:
            age = time.time_ns() // 1000 - seq
            if age > self.window_us:
                return (f"frame from an unknown sender stamped {age / 1e6:.0f}s ago (a replay of an old frame, or "
                        f"clocks more than {self.window_us / 1e6:.0f}s apart)")
        elif seq <= last:
            return "replayed frame (its sender's sequence number was seen already)"
        self._last[sender] = seq
        return None
