"""Child-process helpers shared by the launcher's role processes and the SGLang server an inference worker owns."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any, Callable, Optional

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (thread) dies: no orphans after a kill -9.

    Runs in the child between fork and exec (`preexec_fn`), or in a process that wants to die with its launcher.
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def die_with_parent_preexec() -> Optional[Callable[[], None]]:
    """`preexec_fn` for Popen: `die_with_parent` where the kernel supports it (Linux), else nothing."""
    return die_with_parent if sys.platform.startswith("linux") else None


def tail(path: str, n: int = 20) -> str:
    """The last `n` lines of a log file (read from its last 16 KiB), for error messages about a dead child."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-n:])
    except OSError as e:
        return f"<no log: {e}>"


def signal_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group led by `pid` (children started with start_new_session), or to `pid` alone
    when it has no group of its own; a process that is already gone is not an error."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def trim_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere).

    Why: glibc keeps freed blocks in the arena of the thread that allocated them, and tensors under its mmap
    threshold come from there; a process whose threads take turns allocating and freeing (a decode thread filling a
    KV cache that a weight update clears, executor threads reading weights) holds the high-water mark of each arena
    and its RSS creeps up with the run. Costs a few ms for a few hundred MB."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass


_SELF: Any = None


def rss_mib() -> Optional[float]:
    """This process's resident memory in MiB (None where psutil cannot read it): every heartbeat carries it, so a
    role whose memory grows with the work done shows in the run's records long before it runs out."""
    global _SELF
    try:
        import psutil

        if _SELF is None or _SELF.pid != os.getpid():  # a forked child asks about itself, not its parent
            _SELF = psutil.Process()
        return round(_SELF.memory_info().rss / 2**20, 1)
    except Exception:  # noqa: BLE001 - no psutil, or a platform it cannot read: the heartbeat goes without it
        return None
