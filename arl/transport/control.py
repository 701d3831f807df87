"""A role process's link to the controller, and the sockets it makes.

Every socket gets the run's shared secret (HMAC on every frame) and frame-size limit from `SOCKET_OPTIONS`, which
the role's process entry (`arl.launch.role`) fills in before any socket exists.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from typing import Any, Awaitable, Callable, Optional, TypeVar

from arl.transport.messages import ControlMessage, Error, Heartbeat, Register, parse
from arl.transport.security import advertised_address, effective_bind_host
from arl.transport.sockets import Dealer, bind_random
from arl.utils.proc import rss_mib

logger = logging.getLogger("arl.worker")

SOCKET_OPTIONS: dict[str, Any] = {}
_S = TypeVar("_S")


def make_socket(cls: Callable[..., _S]) -> _S:
    return cls(**SOCKET_OPTIONS)


def host_address(bind_host: str) -> str:
    """This machine's address on the run's interface (a wildcard bind host: its own address), for gloo."""
    return advertised_address(f"tcp://{effective_bind_host(bind_host)}:0")[len("tcp://"):].rsplit(":", 1)[0]


def bind(sock: Any, bind_host: str) -> str:
    """Bind to a free port on the run's host; the returned address is one other machines can use (no wildcard)."""
    return advertised_address(bind_random(sock, effective_bind_host(bind_host)))


HEARTBEAT_SECONDS = 1.0


class ControlChannel:
    """The role's DEALER to the controller: replies are awaited by type, commands dispatched to handlers."""

    def __init__(self, address: str, role: str, index: int, fingerprint: Optional[dict] = None) -> None:
        """`fingerprint`: what this process runs (`arl.utils.fingerprint`), sent with its registrations."""
        self.dealer = make_socket(Dealer).connect(address)
        self.role, self.index, self.fingerprint = role, index, fingerprint
        # command type -> handler of its typed message (a coroutine function, or a plain one for a quick command)
        self.handlers: dict[str, Callable[[Any], Any]] = {}
        self._waiters: dict[str, asyncio.Future] = {}
        self.stopped = asyncio.Event()

    async def post(self, msg: ControlMessage) -> None:
        """Send a typed control message (a plain map on the wire)."""
        await self.dealer.send(msg.TYPE, msg.to_payload())

    async def register(self, timeout: float, index: Optional[int] = None, address: Optional[str] = None,
                       weights_store: Optional[str] = None, resumed: Optional[dict] = None) -> dict:
        """Register as this role (or as hosted inference server `index`); returns the controller's ack.
        `resumed`: a restarted learner's checkpoint (`Register.resumed`). RuntimeError with the controller's reason
        when it refuses this process (another model or config than the run's)."""
        ack = await self.request(Register(role=self.role, index=self.index if index is None else index,
                                          address=address, pid=os.getpid(), weights_store=weights_store,
                                          resumed=resumed, fingerprint=self.fingerprint), "ack", timeout)
        if ack.get("ok") is False:
            raise RuntimeError(f"{self.role}{self.index}: the run refused this process: {ack.get('message')}")
        return ack

    async def request(self, msg: ControlMessage, reply_type: str, timeout: float) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self._waiters[reply_type] = fut
        await self.post(msg)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{self.role}{self.index}: no '{reply_type}' from the controller in {timeout}s")

    async def loop(self) -> None:
        while True:
            msg_type, payload = await self.dealer.recv()
            if msg_type in self._waiters:
                fut = self._waiters.pop(msg_type)
                if not fut.done():
                    fut.set_result(payload)
            elif msg_type == "shutdown":
                self.stopped.set()
            elif msg_type in self.handlers:
                asyncio.create_task(self._run_handler(msg_type, payload))
            else:
                logger.warning("unexpected control message %s", msg_type)

    async def _run_handler(self, msg_type: str, payload: dict) -> None:
        try:  # the handler gets the typed command; a malformed one is reported like a failed handler
            result = self.handlers[msg_type](parse(msg_type, payload))
            if inspect.isawaitable(result):
                await result
        except Exception as e:  # noqa: BLE001 - report, then let the controller decide
            logger.exception("handler for %s failed", msg_type)
            await self.post(Error(message=f"{self.role}{self.index}: {msg_type} failed: {e}"))

    def beat(self, stats: dict, index: Optional[int] = None) -> Heartbeat:
        """A heartbeat as this role (or as hosted inference server `index`) carrying `stats` and the process's
        resident memory (`rss_mib`), which the controller records per role."""
        return Heartbeat(role=self.role, index=self.index if index is None else index,
                         stats={**stats, "rss_mib": rss_mib()})

    async def heartbeat(self, stats: Callable[[], dict], index: Optional[int] = None) -> None:
        """Heartbeat as this role (or as hosted inference server `index`) every HEARTBEAT_SECONDS."""
        while True:
            await self.post(self.beat(stats(), index))
            await asyncio.sleep(HEARTBEAT_SECONDS)


RoleParts = tuple[list[Awaitable], list[Awaitable]]  # (coroutines to run, cleanups)


async def aclose(sock: Any) -> None:
    sock.close()


