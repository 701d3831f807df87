"""The roles' control sends in tests: `typed(send)` adapts a test's ``send(msg_type, payload)`` recorder to a role's
``send_control``, which must get typed messages (`arl.transport.messages`) only. A role that sends anything else (a
type name and a raw map, as roles once did) fails the test at that send."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from arl.transport.messages import ControlMessage, SendControl


def typed(send: Callable[[str, dict], Awaitable[Any]]) -> SendControl:
    async def post(*args: Any) -> None:
        if len(args) != 1 or not isinstance(args[0], ControlMessage):
            raise AssertionError(f"a role sent an untyped control message: {args!r:.120}")
        await send(args[0].TYPE, args[0].to_payload())

    return post
