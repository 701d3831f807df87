"""Sockets used from more than one event loop in turn (e.g. successive asyncio.run calls in a script)."""

import asyncio

import pytest

from arl.transport.sockets import Pull, Push

pytestmark = pytest.mark.timeout(30)

T = 5.0


def test_a_socket_keeps_sending_after_its_event_loop_changed():
    """A batch whose flush was scheduled on a loop that ended must not stall the socket in the next one (it goes
    out with the next batch)."""
    push, pull = Push(), Pull()
    try:
        pull.connect(push.bind_random())

        async def receive() -> dict:
            return (await pull.recv(timeout=T))[1]

        async def send(i: int, then_stop: bool) -> None:
            await push.send("heartbeat", {"i": i})
            if then_stop:
                asyncio.get_running_loop().stop()  # the loop ends before the flush it scheduled can run

        async def first() -> dict:  # one loop until it arrived: a PUSH holds its batch until the peer is connected
            await send(-1, False)
            return await receive()

        assert asyncio.run(first()) == {"i": -1}
        loop = asyncio.new_event_loop()
        loop.create_task(send(0, True))
        loop.run_forever()
        loop.close()
        asyncio.run(send(1, False))
        assert [asyncio.run(receive()) for _ in range(2)] == [{"i": 0}, {"i": 1}]  # nothing lost, in order
    finally:
        push.close()
        pull.close()
