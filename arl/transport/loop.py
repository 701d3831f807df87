"""An event loop that polls before it sleeps (opt-in, config ``busy_poll_us``).

Why: at low load every message wakes a sleeping event loop. On hosts where waking an idle core is slow (VMs: an
IPI and a halted vCPU; measured here, tens of microseconds per wake and a cold cache after) a round trip pays
that on both sides. Polling for a short while before sleeping handles a message that arrives meanwhile without
the sleep. It costs up to ``busy_poll_us`` of CPU each time the loop would otherwise go idle, so it is off by
default; under load the loop rarely idles and the setting changes nothing (scripts/bench_transport.py
``--busy-poll-us``).
"""

from __future__ import annotations

import asyncio
import selectors
import time
from typing import Any, Coroutine, Optional, TypeVar

T = TypeVar("T")


class PollingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """A select that would block first does zero-timeout selects for up to `poll_s` seconds."""

    def __init__(self, poll_s: float) -> None:
        super().__init__()
        self.poll_s = poll_s

    def select(self, timeout: Optional[float] = None) -> list:
        if timeout is not None and timeout <= 0:
            return super().select(timeout)
        start = time.perf_counter()
        end = start + (self.poll_s if timeout is None else min(self.poll_s, timeout))
        while True:
            ready = super().select(0)
            now = time.perf_counter()
            if ready or now >= end:
                break
        if ready:
            return ready
        return super().select(None if timeout is None else max(0.0, timeout - (now - start)))


def new_event_loop(busy_poll_us: float = 0.0) -> asyncio.AbstractEventLoop:
    """A plain asyncio loop, or with ``busy_poll_us > 0`` one whose selector polls that long before sleeping."""
    if busy_poll_us <= 0:
        return asyncio.new_event_loop()
    return asyncio.SelectorEventLoop(PollingSelector(busy_poll_us / 1e6))


def run(main: Coroutine[Any, Any, T], busy_poll_us: float = 0.0) -> T:
    """``asyncio.run(main)``, on a polling loop when ``busy_poll_us > 0``."""
    if busy_poll_us <= 0:
        return asyncio.run(main)

    def factory() -> asyncio.AbstractEventLoop:
        loop = new_event_loop(busy_poll_us)
        asyncio.set_event_loop(loop)  # like asyncio.run: code that asks for "the" loop gets this one
        return loop

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
