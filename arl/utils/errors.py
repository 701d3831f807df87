"""A failure said in a few bounded lines: its message and the last frames of where it was raised. Sent with a
dropped group to the controller, which prints the newest when a run stops for drops or a stall (the full
traceback stays in the role's log)."""

from __future__ import annotations

import traceback
from typing import Optional

class ConfigError(ValueError):
    """A user-facing configuration problem; the CLI prints it without a traceback. (Here, below `arl.config` which
    re-exports it, so the transport's security checks can raise it without importing config.)"""


MAX_ERROR_CHARS = 1500  # what one dropped group's error may add to a control message


def describe_error(message: str, exc: Optional[BaseException] = None, frames: int = 3,
                   limit: int = MAX_ERROR_CHARS) -> str:
    """`message`, then the last `frames` frames of `exc`'s traceback (none without `exc`), in at most `limit`
    characters: a long message is cut in the middle of its text, the frames keep their innermost lines."""
    tb = traceback.extract_tb(exc.__traceback__)[-frames:] if exc is not None and frames > 0 else []
    where = "".join(traceback.format_list(tb)).rstrip("\n")
    head = message if len(message) <= limit // 2 or not where else message[: limit // 2 - 3] + "..."
    if not where:
        return head[:limit]
    room = max(0, limit - len(head) - len("\nraised at (innermost last):\n"))
    if len(where) > room:
        where = "..." + where[len(where) - room + 3:] if room > 3 else ""
    return f"{head}\nraised at (innermost last):\n{where}" if where else head


def exception_text(exc: BaseException) -> str:
    """'ValueError: the reward service is down' (the class alone for an exception without a message)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
