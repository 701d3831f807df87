"""The opt-in polling event loop (config busy_poll_us)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from arl.transport.loop import PollingSelector, new_event_loop, run
from arl.transport.sockets import Dealer, Router

pytestmark = pytest.mark.timeout(30)


def test_polling_selector_sees_ready_fds_and_honours_the_timeout():
    a, b = socket.socketpair()
    sel = PollingSelector(0.002)
    try:
        sel.register(a, 1)  # EVENT_READ
        assert sel.select(0.01) == []  # nothing to read: polls, then sleeps out the rest of the timeout
        assert sel.select(0) == []
        b.send(b"x")
        (key, events), = sel.select(None)  # found while polling, no blocking select needed
        assert key.fileobj is a and events == 1
    finally:
        sel.close()
        a.close()
        b.close()


def test_run_uses_a_polling_loop_only_when_asked():
    async def which() -> type:
        return type(asyncio.get_running_loop()._selector)  # type: ignore[attr-defined]

    assert run(which(), busy_poll_us=200) is PollingSelector
    assert run(which()) is not PollingSelector
    loop = new_event_loop(0)
    try:
        assert not isinstance(loop._selector, PollingSelector)  # type: ignore[attr-defined]
    finally:
        loop.close()


def test_request_response_and_timers_on_a_polling_loop():
    async def main() -> list:
        router, dealer = Router(), Dealer()
        try:
            dealer.connect(router.bind_random())
            out = []
            for i in range(20):
                await dealer.send("heartbeat", {"i": i})
                ident, _, payload = await router.recv(timeout=5)
                await router.send(ident, "ack", payload)
                out.append((await dealer.recv(timeout=5))[1]["i"])
            await asyncio.sleep(0.01)  # a timer while nothing is ready: the poll gives way to the sleep
            return out
        finally:
            router.close()
            dealer.close()

    assert run(main(), busy_poll_us=500) == list(range(20))
