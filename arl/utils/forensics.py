"""Hang forensics: every role can dump its Python stacks on SIGUSR1, and the controller can ask for that dump.

A role that stops heartbeating is either stuck (a blocked event loop, a deadlock, a hung native call) or stopped
(SIGSTOP, a debugger). Before the controller restarts it or stops the run, it names the role and what it last
said it was waiting on, and gets its stacks: `faulthandler` dumps every thread from a C-level signal handler, so
this works even while the interpreter's main thread is busy in a loop that never yields.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

__all__ = ["install_stack_dump_handler", "process_state", "request_stack_dump", "read_from"]

DUMP_SIGNAL = signal.SIGUSR1


def install_stack_dump_handler() -> None:
    """Dump all threads' stacks to stdout (the role's log) on SIGUSR1, and on a fatal signal (SIGSEGV, SIGABRT,
    ...)."""
    faulthandler.enable(file=sys.stdout, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=sys.stdout, all_threads=True, chain=False)


def _stat(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...); [] if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        return stat[stat.rindex(")") + 2:].split()
    except (OSError, ValueError):
        return []


def process_state(pid: int) -> str:
    """The kernel's one-letter state of `pid` (R running, S sleeping, D disk wait, T stopped, Z zombie), or '?'."""
    return (_stat(pid) or ["?"])[0]


def _children(pid: int) -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _stat(e)[1:2] == [str(pid)]]


def dump_targets(pid: int) -> list[int]:
    """The processes to signal for `pid`'s stacks: itself, or for a torchrun launcher (which has no handler and
    would die of SIGUSR1) its rank processes."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return [pid]
    if any(a in (b"torch.distributed.run", b"torchrun") or a.endswith(b"/torchrun") for a in argv):
        return _children(pid)
    return [pid]


def log_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def read_from(path: str, offset: int, limit: int = 64 * 1024) -> str:
    """What `path` gained after `offset` (at most `limit` bytes, the newest kept)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            start = max(offset, end - limit)
            f.seek(start)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def request_stack_dump(pid: int, log_path: str, wait: float = 2.0) -> tuple[str, str]:
    """Send SIGUSR1 to `pid` and wait up to `wait` seconds for its stack dump to appear in `log_path`.

    A stopped process (state T) cannot run its handler: it is sent SIGCONT right after, so the dump is written
    before the caller kills or restarts it. Returns (process state before the signal, the dump text or "").
    Blocking: call it from a thread (asyncio.to_thread) in an event loop.
    """
    state = process_state(pid)
    start = log_size(log_path)
    sent = 0
    for target in dump_targets(pid):
        try:
            stopped = process_state(target) == "T"
            os.kill(target, DUMP_SIGNAL)
            if stopped:
                os.kill(target, signal.SIGCONT)
            sent += 1
        except (ProcessLookupError, PermissionError):
            pass
    if not sent:
        return state, ""
    deadline = time.monotonic() + wait
    text = ""
    while time.monotonic() < deadline:
        time.sleep(0.1)
        text = read_from(log_path, start)
        if "most recent call first" in text:
            time.sleep(0.2)  # let the other threads' stacks land too
            return state, read_from(log_path, start)
    return state, text
