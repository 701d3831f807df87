"""Waiting on a condition instead of sleeping a fixed time: a test that sleeps "long enough" races on a slow or
loaded machine, one that polls the condition itself does not (the deadline is only a hang guard, keep it generous)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable


def wait_until(pred: Callable[[], bool], timeout: float = 60.0, what: str = "the condition",
               interval: float = 0.05) -> None:
    """Return as soon as `pred()` is true; AssertionError naming `what` if it is still false after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


async def await_until(pred: Callable[[], bool], timeout: float = 60.0, what: str = "the condition",
                      interval: float = 0.005) -> None:
    """`wait_until` for a test running in an event loop (the loop keeps running while it waits)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(interval)
