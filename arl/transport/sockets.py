"""asyncio sockets over pyzmq that speak the codec's frames (non-blocking calls; waiting watches ZMQ_FD with
``loop.add_reader``, see ``_Socket.__init__``; the Context is a zmq.asyncio one, so raw asyncio sockets mix in).

One zmq Context per process (``context()``). Each socket:

* encodes on ``send`` (raising TypeError/ValueError for the *caller's* bad objects, or for a frame over
  ``max_bytes``) and decodes on ``recv``;
* never raises for a *peer's* bad input: a malformed frame (or a multipart message of the wrong shape) is dropped,
  counted in ``stats["malformed"]`` and logged on logger ``arl.transport`` at most once per second per socket;
* counts ``stats["sent"]`` and ``stats["received"]`` (good messages only); a Router also counts
  ``stats["dropped"]`` (a reply to a peer that is gone or whose queue is full; a Router never blocks on one
  client);
* has ``recv(timeout=None)`` (``asyncio.TimeoutError`` on expiry; not on a Push) and ``close()`` (LINGER 0,
  idempotent). A
  ``recv`` pending when its socket is closed, or a call after, raises ``SocketClosed``.

Batching: ``send`` queues the frame and the socket flushes its queue once per event-loop iteration (``call_soon``),
as ONE zmq message per peer whose frames are the envelopes: [frame, ...] (Router: [identity, frame, ...]). A
receiver takes any number of frames and hands them out one message at a time, each decoded (and checked)
separately. Why: on small messages a zmq send costs mostly the wake-up of zmq's I/O thread (a cross-CPU wake on a
VM costs the sender tens of microseconds), and a receive costs an event-loop wake; with many requests in flight
one of each per iteration instead of per message multiplies the round trips per second
(scripts/bench_transport.py). A lone request waits one loop iteration more (a zero-timeout poll). A Dealer/Push
batch that finds no room (or no peer yet) stays queued and later sends wait; if its event loop ends first, it goes
out with the socket's next send in another loop, or at ``close()``. ``send_nowait`` (Router, Dealer) queues from
plain code (a callback); with ``flush=True`` the peer's queue goes to zmq at once (the caller batched already:
env servers' ``env_calls`` / ``env_replies``).

With ``secret`` every frame carries an HMAC-SHA256 tag and frames without a valid tag count as malformed; an
authentic frame this socket has seen already (or an old one from a sender it never heard) is dropped and counted as
``replayed`` (``arl.transport.replay``).
Frames up to ``max_bytes`` are decoded; larger ones are counted as malformed, and above ``2 * max_bytes`` libzmq
itself drops the peer's connection (ZMQ_MAXMSGSIZE) so a runaway sender cannot exhaust memory.

Patterns: Router (bind) <-> Dealer (connect) for request/response; Push -> Pull for trajectories. Every socket may
``bind``, ``bind_random`` or ``connect``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from typing import Any, Optional

import zmq
import zmq.asyncio

from arl.transport.codec import DEFAULT_MAX_BYTES, TAG_SIZE, MalformedMessage, ReplayedMessage, decode, encode
from arl.transport.replay import ReplayGuard, Stamper

__all__ = ["DEFAULT_HWM", "SocketClosed", "FrameTooLarge", "context", "bind_random", "Router", "Dealer", "Push", "Pull"]

logger = logging.getLogger("arl.transport")

DEFAULT_HWM = 10_000  # messages queued per peer before backpressure (Dealer/Push) or drops (Router)
_WARN_INTERVAL_S = 1.0
_MAX_FAST_STREAK = 64  # receives served from the queue without yielding to the event loop
# Frames queued for one peer before they go without waiting for the end of the iteration: small enough that the
# peer starts on the first ones while we queue the rest (a cap of 64 halved the round trips/s at 64 in flight:
# client and server took turns instead of overlapping), large enough to share one I/O-thread wake among many.
_MAX_BATCH = 16
# plain ints: pyzmq's enum flags cost microseconds per `&` and per call on this hot path
_DONTWAIT, _EVENTS, _POLLIN, _POLLOUT = int(zmq.DONTWAIT), int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)
_SNDMORE = int(zmq.SNDMORE)  # (send_multipart builds an enum from 'SNDMORE | flags' per part)


class FrameTooLarge(ValueError):
    """A frame to send is over the socket's `max_bytes` (the peer would drop it): nothing was sent."""

    def __init__(self, msg_type: str, size_bytes: int, limit: int) -> None:
        super().__init__(f"{msg_type} frame of {size_bytes} bytes exceeds max_bytes={limit}")
        self.size_bytes, self.limit = size_bytes, limit


class SocketClosed(ConnectionError):
    """recv()/send() on a socket that is (or got) closed."""


_ctx: Optional[zmq.asyncio.Context] = None
_ctx_pid = -1


def context() -> zmq.asyncio.Context:
    """The process-wide zmq.asyncio Context (a fresh one after fork). Kept here rather than via
    ``zmq.asyncio.Context.instance()``, which can hand back a plain Context if one was made first."""
    global _ctx, _ctx_pid
    if _ctx is None or _ctx_pid != os.getpid() or _ctx.closed:
        _ctx = zmq.asyncio.Context()
        _ctx_pid = os.getpid()
    return _ctx


def bind_random(sock: "_Socket", host: str = "127.0.0.1") -> str:
    """``sock.bind_random(host)``: bind to a free TCP port on ``host``; return the address.

    Loopback by default; pass a configured host (an interface address) for multi-host runs. A wildcard host
    ("*", "0.0.0.0") binds every interface, and the returned address must then be rewritten before others connect.
    """
    return sock.bind_random(host)


class _Socket:
    _kind: int = -1
    # Router: messages carry the peer's identity first; a batch that cannot go is dropped and counted
    # (stats["dropped"]), never waited for
    _drops = False

    def __init__(self, *, secret: Optional[bytes] = None, max_bytes: int = DEFAULT_MAX_BYTES, hwm: int = DEFAULT_HWM,
                 name: Optional[str] = None) -> None:
        if secret is not None and not isinstance(secret, bytes):
            raise TypeError("secret must be bytes or None")
        sock = context().socket(self._kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_bytes + TAG_SIZE)
        self._sock = sock
        # Every operation goes through a plain (non-asyncio) view of the socket with DONTWAIT: a message that is
        # already queued is taken without creating a Future. Waiting (empty queue on recv, full queue on send)
        # watches the socket's ZMQ_FD with loop.add_reader and wakes one waiter per ready direction: a fraction
        # of the per-message cost of zmq.asyncio's generic future machinery (measured: scripts/bench_transport.py).
        # ZMQ_FD only signals that ZMQ_EVENTS may have changed, and reading ZMQ_EVENTS (or a send/recv) consumes
        # the signal, so after every operation with someone waiting, _wake() re-reads ZMQ_EVENTS itself.
        self._sync = zmq.Socket.shadow(sock.underlying)
        self._fd = self._sync.getsockopt(zmq.FD)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._watching = False
        self._recv_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._send_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._fast_streak = 0
        # route (a Router's peer identity, else None) -> frames queued in this loop iteration
        self._outbox: dict[Optional[bytes], list[bytes]] = {}
        self._flush_handle: Optional[asyncio.Handle] = None
        self._flush_loop: Optional[asyncio.AbstractEventLoop] = None
        self._drainer: Optional[asyncio.Task] = None  # Dealer/Push: sends a batch the peer's queue had no room for
        self._inbox: collections.deque = collections.deque()  # decoded messages of a received batch not yet returned
        self._secret = secret
        self._max_bytes = max_bytes
        self.name = name or type(self).__name__
        self.stats: dict[str, int] = {"received": 0, "sent": 0, "malformed": 0}
        # with a secret: this socket's stamps, and the newest stamp heard from each sender (arl.transport.replay)
        self._stamper = Stamper() if secret is not None else None
        self._guard = ReplayGuard() if secret is not None else None
        if secret is not None:
            self.stats["replayed"] = 0
        if self._drops:  # a Router: unroutable replies raise (we count them) instead of vanishing
            self.stats["dropped"] = 0
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.addresses: list[str] = []
        self._closed = False
        self._last_warn = -1e9
        self._suppressed = 0

    # ----------------------------------------------------------------- lifecycle / addressing

    def bind(self, address: str) -> str:
        """Bind an explicit endpoint (an ipc:// path, a fixed port); the endpoint as zmq resolved it."""
        self._sock.bind(address)
        endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.addresses.append(endpoint)
        return endpoint

    def bind_random(self, host: str = "127.0.0.1") -> str:
        """Bind to a free TCP port on ``host`` (see the module function); the address."""
        if ":" in host and not host.startswith("["):  # IPv6 literal
            self._sock.setsockopt(zmq.IPV6, 1)
            host = f"[{host}]"
        address = f"tcp://{host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"
        self.addresses.append(address)
        return address

    def connect(self, address: str) -> "_Socket":
        if address.startswith("tcp://["):
            self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.connect(address)
        self.addresses.append(address)
        return self

    def close(self) -> None:
        if not self._closed:
            if self._flush_handle is not None:
                self._flush_handle.cancel()
            if self._outbox:  # what was sent before close() still goes out (best effort; _flush never raises)
                self._flush()
            self._closed = True
            self._outbox.clear()
            if self._drainer is not None:
                self._drainer.cancel()
            self._unwatch()
            for fut in (*self._recv_waiters, *self._send_waiters):
                if not fut.done():
                    with contextlib.suppress(RuntimeError):  # its event loop is closed already
                        fut.set_exception(SocketClosed(f"{self.name} was closed"))
            self._recv_waiters.clear()
            self._send_waiters.clear()
            self._sock.close(linger=0)

    def __repr__(self) -> str:
        return f"<{self.name} {self.addresses} {self.stats}{' closed' if self._closed else ''}>"

    # ----------------------------------------------------------------- helpers

    def recv(self, timeout: Optional[float] = None) -> Any:
        """Await the next good message: (type, payload), or (identity, type, payload) on a Router;
        ``asyncio.TimeoutError`` after `timeout` seconds."""
        return self._recv() if timeout is None else asyncio.wait_for(self._recv(), timeout)

    def _encode(self, msg_type: str, payload: Any) -> bytes:
        frame = encode(msg_type, payload, secret=self._secret,
                       stamp=self._stamper() if self._stamper is not None else None)
        if len(frame) > self._max_bytes:
            raise FrameTooLarge(msg_type, len(frame), self._max_bytes)
        return frame

    def _warn(self, text: str) -> None:
        now = time.monotonic()
        if now - self._last_warn >= _WARN_INTERVAL_S:
            more = f" (+{self._suppressed} similar suppressed)" if self._suppressed else ""
            logger.warning("%s %s: %s%s", self.name, self.addresses, text, more)
            self._last_warn = now
            self._suppressed = 0
        else:
            self._suppressed += 1

    # ----------------------------------------------------------------- waiting on the ZMQ_FD

    def _watch(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._unwatch()
            self._loop = loop
        if not self._watching:
            loop.add_reader(self._fd, self._wake)
            self._watching = True
        return loop

    def _unwatch(self) -> None:
        if self._watching and self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                self._loop.remove_reader(self._fd)
        self._watching = False

    def _wake(self) -> None:
        """Read ZMQ_EVENTS (re-arming ZMQ_FD) and wake the first waiter of each direction that is ready."""
        if self._closed:
            return
        try:
            events = self._sync.get(_EVENTS)
        except zmq.ZMQError:
            return
        if events & _POLLIN:
            _wake_first(self._recv_waiters)
        if events & _POLLOUT:
            _wake_first(self._send_waiters)

    async def _wait(self, waiters: collections.deque, op: str, checked: bool = False) -> None:
        """Until the socket may be ready for `op` (a wake can be spurious: callers retry the operation).
        `checked`: the caller read ZMQ_EVENTS (not ready) just now, with no await since, so the FD will signal."""
        loop = self._watch()
        fut = loop.create_future()
        waiters.append(fut)
        if not checked:
            self._wake()  # the edge may have been consumed before we started watching
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._wake()  # we were woken but will not act on it: pass the wake on
            raise
        finally:
            with contextlib.suppress(ValueError):
                waiters.remove(fut)
        if self._closed:
            raise SocketClosed(f"{self.name} was closed during {op}")

    async def _yield_now_and_then(self) -> None:
        """Let other tasks run now and then, even while messages keep coming."""
        self._fast_streak += 1
        if self._fast_streak > _MAX_FAST_STREAK:
            self._fast_streak = 1
            await asyncio.sleep(0)
        if self._closed:
            raise SocketClosed(f"{self.name} is closed")

    async def _recv_parts(self) -> list:
        if self._closed:
            raise SocketClosed(f"{self.name} is closed")
        # Try the queue at once only when a message is likely (we were just woken); else check ZMQ_EVENTS first:
        # a receive on an empty queue raises zmq.Again, which costs several times a ZMQ_EVENTS check.
        likely = False
        while True:
            try:
                if not likely and not self._sync.get(_EVENTS) & _POLLIN:
                    self._fast_streak = 0
                    await self._wait(self._recv_waiters, "recv", checked=True)
                    likely = True
                    continue
                parts = self._recv_multipart()
            except zmq.Again:
                self._fast_streak = 0
                likely = False
                continue
            except zmq.ZMQError as e:
                if self._closed or e.errno == zmq.ENOTSOCK:
                    raise SocketClosed(f"{self.name} is closed") from None
                raise
            if self._recv_waiters or self._send_waiters:  # our recv may have consumed the edge they wait for
                self._wake()
            return parts

    def _recv_multipart(self) -> list[bytes]:
        """pyzmq's recv_multipart, reading each part's more-flag from its Frame (``get(RCVMORE)`` builds an
        enum per part); zmq.Again only before the first part (libzmq delivers a multipart message whole)."""
        sync = self._sync
        frame = sync.recv(_DONTWAIT, copy=False)
        parts = [frame.bytes]
        while frame.more:
            frame = sync.recv(_DONTWAIT, copy=False)
            parts.append(frame.bytes)
        return parts

    def _try_send(self, parts: list[bytes]) -> bool:
        """Non-blocking send; False if the queue is full (zmq.Again). Other ZMQErrors propagate."""
        try:
            # the sends pyzmq's send_multipart makes, with int flags
            sync, last = self._sync, len(parts) - 1
            for i in range(last):
                sync.send(parts[i], _DONTWAIT | _SNDMORE, copy=True)
            sync.send(parts[last], _DONTWAIT, copy=True)
        except zmq.Again:
            return False
        finally:
            # Whatever the outcome, the attempt may have consumed the FD edge a waiter (in either direction) is
            # waiting for: a refused reply to a vanished peer once left a Router's receiver asleep on a full queue.
            if self._recv_waiters or self._send_waiters:
                self._wake()
        return True

    async def _recv(self) -> Any:
        """Next good message: (type, payload), or (identity, type, payload) on a Router."""
        await self._yield_now_and_then()
        while not self._inbox:
            parts = await self._recv_parts()
            self._unpack(parts[0] if self._drops else None, parts, 1 if self._drops else 0)
        return self._inbox.popleft()

    def _unpack(self, route: Optional[bytes], parts: list, start: int) -> None:
        """Decode the frames ``parts[start:]`` of one received message into the inbox. All or nothing: our own
        senders never put a bad frame in a batch, so one bad frame marks the whole message as a broken or hostile
        peer's, and every frame of it is dropped and counted as malformed."""
        frames = parts[start:] if start else parts
        if not frames:
            self.stats["malformed"] += 1
            self._warn(f"dropped malformed message: message of {len(parts)} part(s) carries no frame")
            return
        msgs = []
        for i, frame in enumerate(frames):
            try:
                msg = decode(frame, max_bytes=self._max_bytes, secret=self._secret, guard=self._guard)
            except MalformedMessage as e:
                self.stats["replayed" if isinstance(e, ReplayedMessage) else "malformed"] += len(frames)
                self._warn(f"dropped malformed message ({len(frames)} frame(s)): frame {i}: {e}")
                return
            msgs.append(msg if route is None else (route, msg[0], msg[1]))
        self.stats["received"] += len(msgs)
        self._inbox.extend(msgs)

    # ----------------------------------------------------------------- sending: one batch per peer per iteration

    def _queue(self, route: Optional[bytes], frame: bytes, now: bool = False) -> None:
        """`now`: send the route's queue at once (the caller batched already) instead of at the iteration's end."""
        loop = asyncio.get_running_loop()
        if self._flush_loop is not loop:  # first send, or the socket moved to another event loop
            self._flush_loop = loop
            self._flush_handle = None
            if self._drainer is not None and self._drainer.get_loop() is not loop:
                self._drainer = None
        frames = self._outbox.get(route)
        if frames is None:
            frames = self._outbox[route] = []
        frames.append(frame)
        if now or len(frames) >= _MAX_BATCH:  # a sender that does not yield: send what it has so far
            self._flush_now()
        elif self._flush_handle is None and self._drainer is None:
            self._flush_handle = loop.call_soon(self._flush_now)

    def _flush_now(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._drainer is None and not self._closed and not self._flush():
            self._drainer = asyncio.get_running_loop().create_task(self._drain())

    def _flush(self) -> bool:
        """Send the queued frames, one message per route. False if a Dealer/Push batch found no room (it stays
        queued); a Router batch that cannot go is dropped and counted."""
        self._flush_handle = None
        outbox, self._outbox = self._outbox, {}
        for route, frames in outbox.items():
            why = "queue full"
            try:
                ok = self._try_send(frames if route is None else [route, *frames])
            except zmq.ZMQError as e:  # a callback must not raise: the other peers' batches still go
                ok = False
                why = "peer unknown or gone" if e.errno == zmq.EHOSTUNREACH else f"{type(e).__name__}: {e}"
                if not self._drops:  # a Dealer/Push that cannot send at all (closed): nothing to wait for
                    self._warn(f"dropped {len(frames)} message(s): {why}")
                    continue
            if ok:
                self.stats["sent"] += len(frames)
            elif self._drops:  # Router: never block on a peer
                self.stats["dropped"] += len(frames)
                self._warn(f"dropped {len(frames)} message(s) to peer {(route or b'')[:16]!r}: {why}")
            else:  # Dealer, Push: keep them (backpressure) and send them when the peer has room
                self._outbox[route] = frames
                return False
        return True

    async def _drain(self) -> None:
        try:
            while True:
                await self._wait(self._send_waiters, "send")
                if self._flush():
                    return
        finally:
            self._drainer = None

    async def _send_blocking(self, msg_type: str, payload: Any = None) -> None:
        """Queue one frame; waits (backpressure) while an earlier batch waits for room in the peer's queue."""
        if self._closed:
            raise SocketClosed(f"{self.name} is closed")
        frame = self._encode(msg_type, payload)
        while self._drainer is not None and self._drainer.get_loop() is asyncio.get_running_loop():
            await asyncio.wait([self._drainer])
            if self._closed:
                raise SocketClosed(f"{self.name} was closed during send")
        self._queue(None, frame)


def _wake_first(waiters: collections.deque) -> None:
    for fut in waiters:
        if not fut.done():
            fut.set_result(None)
            return


class Router(_Socket):
    """Server side of request/response: ``recv() -> (identity, type, payload)``, ``send(identity, type, payload)``."""

    _kind = zmq.ROUTER
    _drops = True

    async def send(self, identity: bytes, msg_type: str, payload: Any = None) -> None:
        """Queue a reply to ``identity``. Never blocks: if the peer is gone or its queue is full when the batch is
        flushed (end of this loop iteration), the reply is dropped and counted in ``stats["dropped"]``."""
        self.send_nowait(identity, msg_type, payload)

    def send_nowait(self, identity: bytes, msg_type: str, payload: Any = None, *, flush: bool = False) -> None:
        """`send` from plain code (a done callback): a Router send never waits, so no coroutine is needed.
        `flush`: hand the peer's queue to zmq now (the caller batched its messages into this one already)."""
        if self._closed:
            raise SocketClosed(f"{self.name} is closed")
        self._queue(identity, self._encode(msg_type, payload), flush)

    def send_each(self, identities: list[bytes], msg_type: str, payload: Any = None) -> None:
        """The same message to every peer in `identities`, encoded (and tagged) once: a server's report to all
        its subscribers. Never waits, like `send`."""
        if self._closed:
            raise SocketClosed(f"{self.name} is closed")
        frame = self._encode(msg_type, payload)
        for identity in identities:
            self._queue(identity, frame)


class Dealer(_Socket):
    """Client side of request/response: ``send(type, payload)``, ``recv() -> (type, payload)``.

    ``identity`` (optional) sets the routing id the Router sees; otherwise libzmq picks one.
    """

    _kind = zmq.DEALER

    def __init__(self, *, identity: Optional[bytes] = None, **kw: Any) -> None:
        super().__init__(**kw)
        if identity is not None:
            self._sock.setsockopt(zmq.ROUTING_ID, identity)

    send = _Socket._send_blocking

    def send_nowait(self, msg_type: str, payload: Any = None, *, flush: bool = False) -> None:
        """Queue a message from plain code (a callback), never waiting: while an earlier batch waits for room in
        the peer's queue this one queues behind it, so the caller must bound what it sends (env calls: one per
        session in flight). `flush` as for ``Router.send_nowait``."""
        if self._closed:
            raise SocketClosed(f"{self.name} is closed")
        self._queue(None, self._encode(msg_type, payload), flush)


class Push(_Socket):
    """Send side of a pipeline (finished trajectory groups). ``send`` waits while the queue is full."""

    _kind = zmq.PUSH
    send = _Socket._send_blocking


class Pull(_Socket):
    """Receive side of a pipeline: ``recv() -> (type, payload)``, fair-queued over all pushers."""

    _kind = zmq.PULL
