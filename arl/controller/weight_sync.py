"""Which policy version each inference server has, and what to send it next. Pure: no I/O, no clock.

Events go in (a version was published, server i loaded v or failed to, server i was lost / restarted / registered
again) and actions come out: `Send(server, version, path)` (tell it to load that version), `Rejoin(server)` (a
restarted server caught up: route to it again) and `GiveUp(server, ...)` (its loads keep failing: handle it as a
failed server). `live` is the newest version every server in the ack set has loaded, which
the controller gives the staleness gate.

Updates are ordered and coalesced: a server is never sent a version at or below one it has or was already sent,
and has at most one load in flight; versions published meanwhile are not queued, it gets only the newest once it
acked. So a server's version only goes up, and a slow loader skips versions instead of falling further behind.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union


@dataclasses.dataclass(frozen=True)
class Send:
    """Tell `server` to load `version` from `path`; `rollback`: load it even though it has a newer one (the
    learner restarted from an older checkpoint)."""

    server: int
    version: int
    path: str
    rollback: bool = False


@dataclasses.dataclass(frozen=True)
class Rejoin:
    server: int
    version: int


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """Server `server` failed to load weights `attempts` times in a row (the last: `version`, with `error`)."""

    server: int
    version: int
    attempts: int
    error: str = ""


Action = Union[Send, Rejoin, GiveUp]


class WeightSync:
    """Per-server versions of `num_servers` inference servers; every one starts with `initial_version` loaded.
    A server whose load fails is sent the newest version again, up to `max_load_attempts` failures in a row."""

    def __init__(self, num_servers: int, initial_version: int = 0, max_load_attempts: int = 3) -> None:
        self.num_servers = num_servers
        self.published: dict[int, str] = {}  # the newest version -> its weights path
        self.acked = [initial_version] * num_servers  # newest version each server reported loaded
        self.sent = [initial_version] * num_servers  # newest version each server was told to load
        self.lost: set[int] = set()  # out of the ack set (dead, or restarted and not caught up yet)
        self.rejoining: set[int] = set()  # lost servers that were restarted and will rejoin once caught up
        self._registered: set[int] = set()  # rejoining servers whose new process registered
        self.live = initial_version
        self.max_load_attempts = max(1, int(max_load_attempts))
        self.failures = [0] * num_servers  # failed loads in a row, per server
        self.rolling_back: dict[int, int] = {}  # server -> the older version it must load (`rollback`)

    # -- queries ---------------------------------------------------------------------------------------------
    @property
    def newest(self) -> Optional[int]:
        return max(self.published) if self.published else None

    def alive(self) -> list[int]:
        return [i for i in range(self.num_servers) if i not in self.lost]

    def loading(self, server: int) -> bool:
        return self.sent[server] > self.acked[server]

    def lowest_needed(self) -> int:
        """The oldest version whose weights file may still be read: every version below it has been superseded
        on every server in the ack set (each acked a newer one), no load of it is in flight (a server in the ack
        set is only sent versions newer than its ack; a rejoining one may still be loading a version older than
        `live`, which is kept), and a restarted server is sent the newest. Files of older versions can be
        deleted; the newest is never below this."""
        loads = [self.sent[i] for i in range(self.num_servers)
                 if self.loading(i) and (i not in self.lost or i in self.rejoining)]
        return max(0, min([self.live, *loads]))  # -1 while a rollback is under way

    # -- events ----------------------------------------------------------------------------------------------
    def publish(self, version: int, path: str) -> list[Action]:
        """The learner exported `version`: send it to every server in the ack set that is not busy loading."""
        if self.published and version < max(self.published):
            return []  # an older version arriving late: the newest supersedes it
        self.published = {version: path}  # only the newest is ever sent: one entry, not one per step of the run
        return [a for i in self.alive() if (a := self._offer(i)) is not None]

    def loaded(self, server: int, version: int) -> list[Action]:
        """Server `server` reports `version` loaded: next, the newest version if it is behind; a rejoining
        server that caught up rejoins the ack set."""
        if not 0 <= server < self.num_servers:
            raise ValueError(f"no inference server {server}")
        if server in self.lost and server not in self._registered:
            return []  # a late ack from a lost process (or the dead incarnation of a restarted one)
        if server in self.rolling_back:
            if version != self.rolling_back[server]:
                return []  # a load of a lost version that ended after the rollback was sent
            del self.rolling_back[server]
        self.acked[server] = max(self.acked[server], version)
        self.sent[server] = max(self.sent[server], version)
        self.failures[server] = 0
        nxt = self._offer(server)
        if nxt is not None:
            return [nxt]
        if server in self.rejoining and server in self._registered and not self.loading(server):
            self.rejoining.discard(server)
            self._registered.discard(server)
            self.lost.discard(server)
            return [Rejoin(server, self.acked[server])]
        return []

    def load_failed(self, server: int, version: int, error: str = "") -> list[Action]:
        """Server `server` could not load `version` (it keeps the weights it had): send it the newest again, or
        after `max_load_attempts` failures in a row `GiveUp`. A report for no load in flight is ignored (late, or
        from a lost process)."""
        if not 0 <= server < self.num_servers:
            raise ValueError(f"no inference server {server}")
        if (server in self.lost and server not in self._registered) or not self.loading(server) \
                or version != self.sent[server]:
            return []
        self.sent[server] = self.acked[server]  # in a rollback: -1, so the rollback is offered again
        self.failures[server] += 1
        if self.failures[server] >= self.max_load_attempts:
            attempts, self.failures[server] = self.failures[server], 0
            return [GiveUp(server, version, attempts, error)]
        nxt = self._offer(server)
        return [nxt] if nxt is not None else []

    def rollback(self, version: int, path: str) -> list[Action]:
        """The learner restarted from checkpoint `version` (weights at `path`), older than what servers may have
        loaded: every server in the run (and a restarted one that registered) loads it whatever it has; acks of
        other versions are ignored until it did, and `advance()` reports `version` live once all did. A restarted
        server not registered yet started with the initial weights: it gets the newest as usual."""
        self.published = {version: path}
        self.live = -1
        for s in range(self.num_servers):
            if s in self.lost and s not in self._registered:
                if s in self.rejoining:
                    self.acked[s] = self.sent[s] = min(self.acked[s], 0)
                continue
            self.acked[s] = self.sent[s] = -1
            self.failures[s] = 0
            self.rolling_back[s] = version
        return [a for s in sorted(self.rolling_back) if (a := self._offer(s)) is not None]

    def lose(self, servers: list[int]) -> None:
        """`servers` left the ack set (their process died or hung), or restarted ones did not come back (they stay
        lost); `advance()` tells if a version went live."""
        self.lost.update(servers)
        for s in servers:
            self.rolling_back.pop(s, None)
        self.rejoining.difference_update(servers)
        self._registered.difference_update(servers)

    def restarted(self, servers: list[int], initial_version: int = 0) -> None:
        """Lost `servers` run again in a fresh process (with the initial weights); they rejoin once registered
        and caught up with the newest version."""
        for s in servers:
            self.acked[s] = self.sent[s] = initial_version
            self.failures[s] = 0
        self.rejoining.update(servers)

    def add_server(self, initial_version: int = 0) -> int:
        """A server joins the run (its process starts with the `initial_version` weights): out of the ack set until
        it registered and loaded the newest version, then `Rejoin`, as a restarted one. Returns its index."""
        s = self.num_servers
        self.num_servers += 1
        self.acked.append(initial_version)
        self.sent.append(initial_version)
        self.failures.append(0)
        self.lost.add(s)
        self.rejoining.add(s)
        return s

    def registered(self, server: int) -> list[Action]:
        """A restarted server's new process registered: it loads the newest version (or rejoins at once if none
        was published: it started with the initial weights)."""
        if server not in self.rejoining:
            return []
        self._registered.add(server)
        return self.loaded(server, self.acked[server])

    def advance(self) -> Optional[tuple[int, int]]:
        """(previous, new) live version if every server in the ack set now has a newer one, else None."""
        alive = self.alive()
        if not alive:
            return None
        live = min(self.acked[i] for i in alive)
        if live <= self.live:
            return None
        prev, self.live = self.live, live
        return prev, live

    def _offer(self, server: int) -> Optional[Send]:
        """Send `server` the newest version if it is newer than anything it has or was sent and it is idle."""
        v = self.newest
        if v is None or self.loading(server) or v <= self.sent[server]:
            return None
        self.sent[server] = v
        return Send(server, v, self.published[v], rollback=server in self.rolling_back)
