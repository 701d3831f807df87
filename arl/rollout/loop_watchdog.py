"""Noticing a blocked event loop. A rollout worker runs every agent, its inference client and its OpenAI-compatible
endpoint on one asyncio loop, so one synchronous call in an agent (`openai.OpenAI` instead of `AsyncOpenAI`,
`requests`, `time.sleep`, a long CPU step) stalls all of them; a synchronous client calling the worker's own
endpoint even waits for itself until its timeout. The loop cannot see this while it is blocked, so a thread watches
it: the loop stamps a beat every `interval_s`, and a beat later than `threshold_s` past due names the blocked
loop thread's stack (`sys._current_frames`) and the configured agent in a warning, and counts it.

The warning's first line says `BLOCKED`, the line logged when the loop runs again `RESUMED`: the controller looks
for them in the log of a worker that went silent (`blocked_loop_note`), since a blocked loop sends no heartbeat that
could say so.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import sysconfig
import threading
import time
import traceback
from types import FrameType
from typing import Any, Optional

from arl.utils.forensics import read_from

logger = logging.getLogger("arl.rollout")

__all__ = ["LoopWatchdog", "blocked_loop_note", "BLOCKED", "RESUMED"]

BLOCKED = "event loop blocked"
RESUMED = "event loop ran again"
_LIBRARY_DIRS = tuple(sorted({os.path.realpath(p) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")
                              if (p := sysconfig.get_paths().get(k))}))
_HINT = ("a synchronous call in async code (openai.OpenAI instead of openai.AsyncOpenAI, requests, time.sleep, a "
         "long CPU step), which stalls every group of this worker and its OpenAI endpoint (a synchronous client "
         "calling that endpoint waits for itself): await an async client or asyncio.sleep, or run the call in "
         "asyncio.to_thread")


def _user_frame(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The innermost frame outside the standard library and installed packages (the agent's own line, usually)."""
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith("<") and not os.path.realpath(name).startswith(_LIBRARY_DIRS):
            return f
        f = f.f_back
    return frame


def _where(frame: Optional[FrameType]) -> str:
    f = _user_frame(frame)
    if f is None:
        return "an unknown place"
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


def _stack(frame: Optional[FrameType], inner: int) -> str:
    """The blocked stack from two callers above the user's frame down to the innermost frame, the middle elided
    beyond `inner` library frames (an HTTP client's stack is deep)."""
    if frame is None:
        return ""
    frames = []
    f: Optional[FrameType] = frame
    while f is not None:
        frames.append(f)
        f = f.f_back
    frames.reverse()  # outermost first
    user = _user_frame(frame)
    u = next((i for i, f in enumerate(frames) if f is user), len(frames) - 1)
    below = frames[u + 1:]
    keep = frames[max(0, u - 2):u + 1] + (below if len(below) <= inner else below[-inner:])
    lines = traceback.format_list(traceback.StackSummary.extract((f, f.f_lineno) for f in keep))
    if len(below) > inner:
        lines.insert(min(u, 2) + 1, f"  ... {len(below) - inner} library frames ...\n")
    return "".join(lines)


class LoopWatchdog:
    """Warns (and counts) when the event loop it was started on has not run for more than `threshold_s`.

    Args:
        threshold_s: how late the loop's beat may be before it counts as blocked.
        label: who this loop belongs to, for the warning (e.g. "rollout0").
        agent: the agent this loop runs (its registered name and class), for the warning.
        interval_s: how often the loop beats and the thread looks (cheap: one timer callback and one wake-up).
        stack_frames: library frames below the user's own frame put in the warning (the middle is elided).
    """

    def __init__(self, threshold_s: float = 1.0, label: str = "", agent: str = "", interval_s: float = 0.25,
                 stack_frames: int = 8) -> None:
        if threshold_s <= 0 or interval_s <= 0:
            raise ValueError(f"threshold_s and interval_s must be > 0, got {threshold_s}, {interval_s}")
        self.threshold_s, self.interval_s = float(threshold_s), float(interval_s)
        self.label, self.agent = label, agent
        self._stack_frames = stack_frames
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread = 0
        self._due = 0.0  # when the loop's next beat is due (monotonic)
        self._beats = 0
        self._flagged = -1  # the beat number whose lateness the thread already reported
        self._handle: Optional[asyncio.TimerHandle] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.blocks = 0  # times the loop was blocked past the threshold
        self.blocked_s = 0.0  # their total length
        self.max_s = 0.0
        self.last = ""  # where the loop thread was, the last time

    def start(self) -> None:
        """Start watching the running loop (call it on that loop's thread; idempotent)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._due = time.monotonic() + self.interval_s
        self._handle = self._loop.call_later(self.interval_s, self._beat)
        self._thread = threading.Thread(target=self._watch, name=f"loop-watchdog-{self.label}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and the beat (from the loop's thread)."""
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"blocks": self.blocks, "blocked_s": round(self.blocked_s, 3), "max_s": round(self.max_s, 3),
                    "last": self.last}

    def summary(self) -> str:
        """One phrase for `waiting_on` ('' when the loop was never blocked)."""
        with self._lock:
            if not self.blocks:
                return ""
            return (f"its event loop was blocked {self.blocks} time(s) for over {self.threshold_s:g}s (longest "
                    f"{self.max_s:.1f}s), last at {self.last}: {_HINT}")

    # -- the loop's side ---------------------------------------------------------------------------------------
    def _beat(self) -> None:
        now = time.monotonic()
        late = now - self._due
        if late > self.threshold_s:
            with self._lock:
                if self._flagged != self._beats:  # the thread did not see it in time: count it without a stack
                    self.blocks += 1
                    self.last = "an unknown place (the watchdog thread did not run during the block)"
                self.blocked_s += late
                self.max_s = max(self.max_s, late)
            if self._flagged == self._beats:
                logger.warning("%s: %s after %.1fs", self.label, RESUMED, late)
        self._beats += 1
        self._due = now + self.interval_s
        if not self._stop.is_set() and self._loop is not None:
            self._handle = self._loop.call_later(self.interval_s, self._beat)

    # -- the thread's side -------------------------------------------------------------------------------------
    def _watch(self) -> None:
        wait = self.interval_s
        while not self._stop.wait(wait):
            beat, due = self._beats, self._due
            late = time.monotonic() - due
            if late > self.threshold_s and self._flagged != beat:
                self._report(beat, late)
            # wake just after the threshold would be crossed, so a block barely longer than it is still caught
            wait = min(self.interval_s, max(0.02, self.threshold_s - late + 0.02)) if late > 0 else self.interval_s

    def _report(self, beat: int, late: float) -> None:
        frame = sys._current_frames().get(self._loop_thread)  # noqa: SLF001 - the documented way to read it
        where = _where(frame)
        stack = _stack(frame, self._stack_frames)
        with self._lock:
            self._flagged = beat
            self.blocks += 1
            self.last = where
        del frame
        agent = f" running agent {self.agent}" if self.agent else ""
        logger.warning("%s: %s for %.1fs (threshold %gs)%s, at %s; likely %s. The loop thread's stack (innermost "
                       "last):\n%s", self.label, BLOCKED, late, self.threshold_s, agent, where, _HINT, stack)


def blocked_loop_note(log_path: str, limit: int = 256 * 1024) -> str:
    """The watchdog's last `BLOCKED` line in the last `limit` bytes of a log, if the loop did not run again after
    it ('' otherwise): why a worker went silent, when it was its own event loop."""
    text = read_from(log_path, 0, limit)
    i, j = text.rfind(BLOCKED), text.rfind(RESUMED)
    if i < 0 or j > i:
        return ""
    line = text[i:].split("\n", 1)[0]
    return line[:600]
