"""Environments as a role of their own (`env.servers=N`): env-server processes host `EnvironmentService`
instances, one per session, and rollout workers reach them through `RemoteEnv`, which has the same async
`reset` / `step` / `close` (so env groups' `member(i)` works unchanged: each member is a session).

Wire (the project's codec, HMAC and frame limits: `arl.transport.sockets`): a rollout worker's DEALER sends
``env_calls {calls: [{rid, sid, op, ...}, ...]}`` to a server's ROUTER and gets ``env_replies {replies: [{rid, ok,
value | kind, error}, ...]}``: the calls (replies) of one loop iteration to (from) one server go as one frame, one
HMAC; a forged, altered or replayed frame is dropped and counted by the socket, a call that is not a map with a
session id and an op is answered kind "bad_request".
The first `reset` of a session names the env (`name`, `args`) and the server makes it with `make_env`.

Server side: every call runs under `call_timeout` (a hung call is abandoned and its session closed: kind
"timeout"); an env that raises answers kind "error"; a result msgpack cannot carry (an object in `info`) is
refused with kind "not_msgpack" naming its type, not a crash; a session idle past `lease_s` is closed. Client
side: sessions are spread over the live servers by least load (open sessions); a lost server's calls fail at
once with `EnvServerLost` (the rollout worker drops their groups with that reason; their budget returns through
the usual group_done), its sessions are gone, a new `reset` opens a session on another server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import time
from typing import Any, Callable, Optional

from arl.api.agent import EnvironmentService
from arl.rollout.guards import call_with_deadline

logger = logging.getLogger("arl.env")

OPS = ("reset", "step", "close")


class _DeadlineSweep:
    """One timer for many calls that share one timeout, so their deadlines come in the order the calls were made
    (`calls` is insertion-ordered, oldest first): it fires at the oldest call's deadline, hands every call past
    its own to `expire(key, entry)` (removed from `calls`) and re-arms at the next oldest. Each side of the env
    wire keeps one, instead of a timer per call."""

    def __init__(self, calls: dict, deadline: Callable[[Any], float], expire: Callable[[Any, Any], None]) -> None:
        self._calls, self._deadline, self._expire = calls, deadline, expire
        self._timer: Optional[asyncio.TimerHandle] = None

    def arm(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """A call with this deadline was added; arms the timer when none is pending."""
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._fire)

    def _fire(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now, due, nxt = loop.time(), [], None
        for key, entry in self._calls.items():
            if self._deadline(entry) > now:
                nxt = self._deadline(entry)
                break
            due.append(key)
        for key in due:
            self._expire(key, self._calls.pop(key))
        if nxt is not None:
            self._timer = loop.call_at(nxt, self._fire)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def forget(self) -> None:
        """The event loop changed: the pending timer belongs to the old one."""
        self._timer = None


class EnvServerLost(ConnectionError):
    """The env server that held this session was lost (died, hung, restarted): the episode is gone."""


class RemoteEnvError(RuntimeError):
    """The env server refused or failed a call; `kind`: "timeout", "error", "not_msgpack", "bad_request"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Session:
    __slots__ = ("env", "last_used", "busy")

    def __init__(self, env: EnvironmentService) -> None:
        self.env, self.last_used, self.busy = env, time.monotonic(), 0


# calls (client) or replies (server) in one frame at most: enough to share one frame's HMAC and msgpack, one zmq
# message and one wake among many calls; small enough that the peer starts on a batch while the next one fills
# (as the sockets' own _MAX_BATCH)
MAX_BATCH = 32
_ENCODE_ERRORS = (TypeError, ValueError, OverflowError)  # what the codec or msgpack raise for a value it refuses


class EnvServer:
    """One env server: a ROUTER (`router`: recv() -> (identity, type, payload), send_nowait(identity, type,
    payload, flush=...)).

    Why batches: a frame's HMAC, stamp, msgpack envelope, payload check and zmq message cost more CPU than a cheap
    env's step, so a peer's calls come as ``env_calls {calls: [...]}`` and what one loop iteration answers goes back
    as one ``env_replies {replies: [...]}`` (one frame, one HMAC; bad frames are refused by the socket: HMAC,
    replay, codec). Why no coroutine per call: each call is ONE task (the env's own coroutine) with a done
    callback that queues the reply; deadlines are one timer for the oldest call (the timeout is the same for all,
    so calls expire in the order they came), not a timer per call (scripts/bench_envs.py)."""

    def __init__(self, *, index: int, router: Any, make_env: Callable[..., EnvironmentService],
                 call_timeout: float, lease_s: float) -> None:
        self.index = index
        self.router = router
        self.make_env = make_env
        self.call_timeout = float(call_timeout)
        self.lease_s = float(lease_s)
        self.sessions: dict[str, _Session] = {}
        self.stats: collections.Counter = collections.Counter()
        # env calls in flight, oldest first -> (deadline on the loop's clock, ident, rid, sid, op, session)
        self._tasks: dict[asyncio.Future, tuple] = {}
        self._sweep = _DeadlineSweep(self._tasks, lambda entry: entry[0], self._expire)
        self._outbox: dict[bytes, list[dict]] = {}  # peer -> replies of this loop iteration
        self._flush_handle: Optional[asyncio.Handle] = None
        self._slow: set[asyncio.Task] = set()  # rare paths that await (closing a timed-out session)

    async def serve(self) -> None:
        while True:
            ident, msg_type, payload = await self.router.recv()
            calls = payload.get("calls") if msg_type == "env_calls" else None
            if type(calls) is not list:
                self.stats["bad_request"] += 1
                continue
            for p in calls:
                if type(p) is dict:
                    self._start(ident, p)
                else:
                    self.stats["bad_request"] += 1

    # ------------------------------------------------------------------ replies: one frame per peer per iteration

    def _reply(self, ident: bytes, rid: Any, **fields: Any) -> None:
        fields["rid"] = rid
        replies = self._outbox.get(ident)
        if replies is None:
            replies = self._outbox[ident] = []
        replies.append(fields)
        if len(replies) >= MAX_BATCH:
            self._send(ident, self._outbox.pop(ident))
        elif self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        outbox, self._outbox = self._outbox, {}
        for ident, replies in outbox.items():
            self._send(ident, replies)

    def _send(self, ident: bytes, replies: list[dict]) -> None:
        """Send `replies` as one frame; if the codec refuses it, find the replies it refuses (each alone) and
        answer those with kind "not_msgpack" naming what could not go, so one env's bad info costs only its call."""
        try:
            self.router.send_nowait(ident, "env_replies", {"replies": replies}, flush=True)
            return
        except _ENCODE_ERRORS as e:
            if len(replies) > 1:
                for r in replies:
                    self._send(ident, [r])
                return
            self.stats["not_msgpack"] += 1
            rid = replies[0].get("rid")
            error = f"the env's result cannot travel as msgpack: {e}"
        except ConnectionError:  # the router was closed (SocketClosed): nobody to answer
            return
        with contextlib.suppress(ConnectionError):
            self.router.send_nowait(ident, "env_replies",
                                    {"replies": [{"rid": rid, "ok": False, "kind": "not_msgpack", "error": error}]},
                                    flush=True)

    # ------------------------------------------------------------------ calls

    def _start(self, ident: bytes, p: dict) -> None:
        rid, sid, op = p.get("rid"), p.get("sid"), p.get("op")
        if not isinstance(sid, str) or op not in OPS:
            self.stats["bad_request"] += 1
            return self._reply(ident, rid, ok=False, kind="bad_request", error=f"bad env call {op!r}"[:200])
        session = self.sessions.get(sid)
        if session is None:
            if op == "close":
                return self._reply(ident, rid, ok=True, value=None)
            if op == "step":
                return self._reply(ident, rid, ok=False, kind="no_session",
                                   error=f"env session {sid} is not open here (closed, or its lease ran out)")
            try:
                session = self.sessions[sid] = _Session(self.make_env(str(p.get("name")), **dict(p.get("args") or {})))
                self.stats["sessions_opened"] += 1
            except Exception as e:  # noqa: BLE001 - a bad env name or args: the caller's group is dropped
                self.stats["env_error"] += 1
                return self._reply(ident, rid, ok=False, kind="error", error=f"{type(e).__name__}: {e}")
        self.stats["calls"] += 1
        try:
            if op == "reset":
                aw: Any = session.env.reset(seed=p.get("seed"), options=p.get("options"))
            elif op == "step":
                aw = session.env.step(p.get("action"))
            else:
                self.sessions.pop(sid, None)
                aw = session.env.close()
            task = asyncio.ensure_future(aw)
        except Exception as e:  # noqa: BLE001 - an env whose method raises before awaiting, or is not async
            self.stats["env_error"] += 1
            session.last_used = time.monotonic()
            return self._reply(ident, rid, ok=False, kind="error", error=f"{type(e).__name__}: {e}")
        session.busy += 1
        session.last_used = time.monotonic()
        loop = task.get_loop()
        deadline = loop.time() + self.call_timeout
        self._tasks[task] = (deadline, ident, rid, sid, op, session)
        self._sweep.arm(loop, deadline)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future) -> None:
        entry = self._tasks.pop(task, None)
        if entry is None:  # timed out (answered already) or cancelled by close(): only fetch its outcome
            if not task.cancelled():
                task.exception()
            return
        _, ident, rid, _, _, session = entry
        session.busy -= 1
        session.last_used = time.monotonic()
        if task.cancelled():
            self.stats["env_error"] += 1
            return self._reply(ident, rid, ok=False, kind="error", error="CancelledError: the env call was cancelled")
        e = task.exception()
        if e is not None:  # any env bug is the caller's counted drop reason
            self.stats["env_error"] += 1
            return self._reply(ident, rid, ok=False, kind="error", error=f"{type(e).__name__}: {e}")
        value = task.result()
        self._reply(ident, rid, ok=True, value=list(value) if isinstance(value, tuple) else value)

    def _expire(self, task: asyncio.Future, entry: tuple) -> None:
        """A call ran past `call_timeout`: cancel and abandon it, close its session, answer "timeout"."""
        _, ident, rid, sid, op, session = entry
        task.cancel()
        session.busy -= 1
        session.last_used = time.monotonic()
        self.stats["timeouts"] += 1
        t = asyncio.ensure_future(self._timed_out(ident, rid, sid, op))
        self._slow.add(t)
        t.add_done_callback(self._slow.discard)

    async def _timed_out(self, ident: bytes, rid: Any, sid: str, op: str) -> None:
        await self._close(sid)
        self._reply(ident, rid, ok=False, kind="timeout",
                    error=f"{op} took longer than {self.call_timeout:g}s at env server {self.index}; the session "
                          f"was closed")

    async def _close(self, sid: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            self.stats["sessions_closed"] += 1
            with contextlib.suppress(Exception):
                await call_with_deadline(session.env.close(), min(5.0, self.call_timeout))

    async def reap(self, every: Optional[float] = None) -> None:
        """Close sessions idle past their lease (a rollout worker that died never closes its sessions)."""
        while True:
            await asyncio.sleep(every if every is not None else max(0.05, min(5.0, self.lease_s / 4)))
            now = time.monotonic()
            for sid in [s for s, x in self.sessions.items() if not x.busy and now - x.last_used > self.lease_s]:
                self.stats["lease_expired"] += 1
                await self._close(sid)

    def heartbeat_stats(self) -> dict:
        return {"sessions": len(self.sessions), "in_flight": len(self._tasks),
                **{k: int(v) for k, v in self.stats.items()},
                "waiting_on": f"{len(self._tasks)} env calls in flight over {len(self.sessions)} sessions"}

    async def close(self) -> None:
        self._sweep.cancel()
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush()
        calls = list(self._tasks)
        for t in calls:
            t.cancel()
        self._tasks.clear()
        for t in self._slow:
            t.cancel()
        await asyncio.gather(*calls, *self._slow, return_exceptions=True)
        await asyncio.gather(*(self._close(s) for s in list(self.sessions)), return_exceptions=True)


_TIMEOUT = object()  # what a call's future holds when its time ran out


def _time_out(rid: int, entry: tuple) -> None:
    """The client's sweep: a call past its deadline gets _TIMEOUT (unless its reply came first)."""
    fut = entry[0]
    if not fut.done():
        fut.set_result(_TIMEOUT)


class EnvServerClient:
    """A rollout worker's link to every env server: one DEALER each (None while a server is lost).

    A call is a plain future (no task, no timer of its own): the calls of one loop iteration go to each server as
    one ``env_calls`` frame, and one timer, at the oldest call's deadline, times out every call past its own
    (the timeout is the same for all, so calls expire in the order they were made)."""

    def __init__(self, dealers: list[Any], timeout: float) -> None:
        self.dealers: list[Optional[Any]] = list(dealers)
        self.timeout = float(timeout)
        self.epoch = [0] * len(dealers)  # bumped when a server is lost: its sessions are gone
        self.load = [0] * len(dealers)  # open sessions per server
        # calls waiting for a reply, oldest first: rid -> (future, server, deadline on the loop's clock)
        self._pending: dict[int, tuple[asyncio.Future, int, float]] = {}
        self._outbox: dict[int, list[dict]] = {}  # server -> calls of this loop iteration
        self._flush_handle: Optional[asyncio.Handle] = None
        self._sweep = _DeadlineSweep(self._pending, lambda entry: entry[2], _time_out)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._rids = itertools.count(1)
        self._readers: dict[int, asyncio.Task] = {}
        self._sids = itertools.count()
        self._tag = os.urandom(4).hex()
        self.stats: collections.Counter = collections.Counter()
        self.draining: set[int] = set()  # servers leaving the run: no new session goes there

    def start(self) -> None:
        for i, d in enumerate(self.dealers):
            if d is not None and i not in self._readers:
                self._readers[i] = asyncio.get_running_loop().create_task(self._read(i, d))

    def new_sid(self) -> str:
        return f"{self._tag}-{next(self._sids)}"

    def pick(self) -> int:
        """The live server with the fewest open sessions (EnvServerLost when none is live)."""
        live = [i for i, d in enumerate(self.dealers) if d is not None and i not in self.draining]
        if not live:
            raise EnvServerLost("no env server is live (all lost or leaving; waiting for restarts)")
        return min(live, key=lambda i: (self.load[i], i))

    async def _read(self, i: int, dealer: Any) -> None:
        pending = self._pending
        while True:
            msg_type, payload = await dealer.recv()
            replies = payload.get("replies") if msg_type == "env_replies" else None
            if type(replies) is not list:
                self.stats["bad_reply"] += 1
                continue
            for r in replies:
                rid = r.get("rid") if type(r) is dict else None
                if type(rid) is not int:
                    self.stats["bad_reply"] += 1
                    continue
                entry = pending.get(rid)
                if entry is None or entry[1] != i:  # timed out already, or not this server's call: ignored
                    continue
                del pending[rid]
                if not entry[0].done():
                    entry[0].set_result(r)

    def _fail(self, calls: list[dict], error: BaseException) -> None:
        for c in calls:
            entry = self._pending.pop(c["rid"], None)
            if entry is not None and not entry[0].done():
                entry[0].set_exception(error)

    def _flush(self) -> None:
        self._flush_handle = None
        outbox, self._outbox = self._outbox, {}
        for server, calls in outbox.items():
            self._send(server, calls)

    def _send(self, server: int, calls: list[dict]) -> None:
        """Send `calls` as one frame; if the codec refuses it, send each alone so that only the call the codec
        refuses (an action msgpack cannot carry, a frame over the limit) fails, with the codec's error."""
        dealer = self.dealers[server]
        if dealer is None:  # lost meanwhile: server_lost failed these calls already
            return
        try:
            dealer.send_nowait("env_calls", {"calls": calls}, flush=True)
        except _ENCODE_ERRORS as e:
            if len(calls) == 1:
                return self._fail(calls, e)
            for c in calls:
                self._send(server, [c])
        except ConnectionError as e:  # the dealer was closed (SocketClosed)
            self._fail(calls, e)

    async def call(self, server: int, payload: dict) -> Any:
        dealer = self.dealers[server]
        if dealer is None:
            raise EnvServerLost(f"env server {server} was lost")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first call, or this client moved to another event loop: no handle carries over
            self._loop, self._flush_handle = loop, None
            self._sweep.forget()
            self._outbox.clear()
        rid = next(self._rids)
        fut: asyncio.Future = loop.create_future()
        deadline = loop.time() + self.timeout
        self._pending[rid] = (fut, server, deadline)
        self.stats["calls"] += 1
        calls = self._outbox.get(server)
        if calls is None:
            calls = self._outbox[server] = []
        calls.append({"rid": rid, **payload})
        if len(calls) >= MAX_BATCH:
            self._send(server, self._outbox.pop(server))
        elif self._flush_handle is None:
            self._flush_handle = loop.call_soon(self._flush)
        self._sweep.arm(loop, deadline)
        try:
            reply = await fut
        finally:
            self._pending.pop(rid, None)
        if reply is _TIMEOUT:
            self.stats["timeouts"] += 1
            raise TimeoutError(f"env server {server} did not answer {payload.get('op')} within {self.timeout:g}s")
        if not reply.get("ok"):
            raise RemoteEnvError(str(reply.get("kind")), f"env server {server}: {reply.get('error')}")
        return reply.get("value")

    def server_lost(self, i: int) -> None:
        """Server `i` is gone: its calls fail now, its sessions are gone, nothing new goes there."""
        if not 0 <= i < len(self.dealers):
            return
        self.epoch[i] += 1
        self.load[i] = 0
        self.stats["servers_lost"] += 1
        dealer, self.dealers[i] = self.dealers[i], None
        self._outbox.pop(i, None)
        reader = self._readers.pop(i, None)
        if reader is not None:
            reader.cancel()
        for rid, (fut, server, _) in list(self._pending.items()):
            if server == i and not fut.done():
                fut.set_exception(EnvServerLost(f"env server {i} was lost"))
        if dealer is not None:
            dealer.close()

    def server_draining(self, i: int) -> None:
        """Server `i` leaves the run: its open sessions go on there, no new one starts there."""
        self.draining.add(i)

    def server_back(self, i: int, dealer: Any) -> None:
        """Server `i` is (back) at `dealer`'s address: restarted, or new (an index past the known ones: joined)."""
        if i < 0 or i in self.draining:
            dealer.close()
            return
        while len(self.dealers) <= i:  # a server that joined the run (`arl.ctl scale env=+1`)
            self.dealers.append(None)
            self.epoch.append(0)
            self.load.append(0)
        if self.dealers[i] is not None:
            self.server_lost(i)
        self.dealers[i] = dealer
        self.start()

    async def close(self) -> None:
        if self._flush_handle is not None:  # calls made just before close still go (their callers wait on them)
            self._flush_handle.cancel()
            self._flush()
        self._sweep.cancel()
        for t in self._readers.values():
            t.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)
        for d in self.dealers:
            if d is not None:
                d.close()


class RemoteEnv(EnvironmentService):
    """A session on an env server, opened by the first `reset` on the least-loaded live server."""

    def __init__(self, client: EnvServerClient, name: str, args: Optional[dict[str, Any]] = None) -> None:
        self.client, self.name, self.args = client, name, dict(args or {})
        self.sid = client.new_sid()
        self.server: Optional[int] = None
        self._epoch = -1

    def _live(self) -> bool:
        return self.server is not None and self.client.epoch[self.server] == self._epoch

    async def reset(self, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None) -> tuple[Any, dict]:
        if not self._live():  # first reset, or its server was lost: a new episode may start anywhere
            self.server = self.client.pick()
            self._epoch = self.client.epoch[self.server]
            self.client.load[self.server] += 1
        value = await self.client.call(self.server, {"sid": self.sid, "op": "reset", "name": self.name,  # type: ignore[arg-type]
                                                     "args": self.args, "seed": seed, "options": options})
        obs, info = value
        return obs, info

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        if self.server is None:
            raise RuntimeError("RemoteEnv.step before reset")
        if not self._live():
            raise EnvServerLost(f"env server {self.server} was lost; this episode is gone")
        obs, reward, terminated, truncated, info = await self.client.call(
            self.server, {"sid": self.sid, "op": "step", "action": action})
        return obs, reward, terminated, truncated, info

    async def close(self) -> None:
        if self._live():
            assert self.server is not None
            self.client.load[self.server] = max(0, self.client.load[self.server] - 1)
            server, self.server = self.server, None
            await self.client.call(server, {"sid": self.sid, "op": "close"})


async def run_env_server(cfg: Any, ctl: Any, index: int, run_dir: str) -> Any:
    """The env-server role's process (`python -m arl.launch.role --role env`): one EnvServer, registered with its
    address, heartbeating its sessions."""
    from arl.api.registry import make_env
    from arl.transport.control import aclose, bind, make_socket
    from arl.transport.sockets import Router

    router = make_socket(Router)
    address = bind(router, cfg.bind_host)
    call_timeout = cfg.env.call_timeout or 0.9 * cfg.rollout.env_timeout  # the server gives up first
    server = EnvServer(index=index, router=router, make_env=make_env, call_timeout=call_timeout,
                       lease_s=cfg.env.session_lease_s)
    await ctl.register(cfg.startup_timeout, address=address)
    logger.info("env server %d at %s (call timeout %gs, session lease %gs)", index, address, call_timeout,
                cfg.env.session_lease_s)
    return [server.serve(), server.reap(), ctl.heartbeat(server.heartbeat_stats)], [server.close(), aclose(router)]
