"""Stand-ins for the controller's I/O: a router that records what is sent, a launcher without processes."""

from __future__ import annotations

from typing import Any, Optional, Sequence


class FakeRouter:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, str, dict]] = []
        self.stats = {"received": 0, "sent": 0, "malformed": 0, "dropped": 0}

    async def send(self, ident: bytes, msg_type: str, payload: Optional[dict] = None) -> bool:
        self.sent.append((ident, msg_type, payload or {}))
        return True

    def close(self) -> None:
        pass


class FakeLauncher:
    """A `RoleLauncher` whose processes are names: `exit(name, code)` makes one die."""

    runs_ranks = False

    def __init__(self) -> None:
        self.env: dict[str, str] = {}
        self.aborted = self.closed = False
        self.running: dict[str, bool] = {}
        self.codes: dict[str, int] = {}
        self.expected: set[str] = set()
        self.spawns: list[str] = []
        self.killed: list[str] = []
        self.waiting: dict[str, str] = {}  # name -> why its start waits (`pending`)

    def abort(self) -> None:
        self.aborted = True

    def spawn(self, name: str, argv: Sequence[str], log_path: str) -> None:
        self.running[name] = True
        self.expected.discard(name)
        self.spawns.append(name)

    def respawn(self, name: str) -> None:
        self.spawn(name, [], "")

    add = spawn  # elastic (tests set `elastic`): a role added mid-run
    unfit = ""  # what `fits` answers

    def fits(self, role: str, index: int) -> str:
        return self.unfit

    def remove(self, name: str) -> None:
        self.kill(name)

    def kill(self, name: str) -> None:
        self.expected.add(name)
        if self.running.get(name):
            self.running[name] = False
            self.killed.append(name)

    def exit(self, name: str, code: int) -> None:
        self.running[name] = False
        self.codes[name] = code

    def dead(self) -> list[tuple[str, Optional[int]]]:
        return [(n, self.codes.get(n)) for n, up in self.running.items() if not up and n not in self.expected]

    def has(self, name: str) -> bool:
        return name in self.running

    def alive(self, name: str) -> bool:
        return self.running.get(name, False)

    def log_path(self, name: str) -> str:
        return f"/nonexistent/{name}.log"

    def stack_dump(self, name: str, wait: float) -> tuple[str, str]:
        return "T", "Thread 0x1 (most recent call first):"

    def expect_exit(self) -> None:
        self.expected.update(self.running)

    def wait_all(self, timeout: float) -> bool:
        return True

    def terminate_all(self, grace: float) -> None:
        for n in self.running:
            self.running[n] = False

    def where(self, name: str) -> dict[str, Any]:
        return {}

    def pending(self, name: str) -> str:
        return self.waiting.get(name, "")

    def close(self) -> None:
        self.closed = True
