"""Load prompt rows from a jsonl file: each line an object with `id`, `prompt` (str) or `messages`
(list of {"role", "content"}), and `answer`."""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any

logger = logging.getLogger(__name__)


def _row_problem(row: Any) -> str | None:
    """Why `row` is unusable, or None if it is fine."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if "id" not in row or row["id"] is None or (isinstance(row["id"], str) and not row["id"]):
        return "missing field 'id'"
    if "answer" not in row or row["answer"] is None:
        return "missing field 'answer'"
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            return "field 'prompt' must be a string"
    elif "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        ):
            return "field 'messages' must be a non-empty list of {'role': str, 'content': str}"
    else:
        return "missing field 'prompt' (or 'messages')"
    return None


def load_jsonl(path: str, *, skip_bad_rows: bool = True) -> list[dict]:
    """Read rows; `id` and `answer` are turned into strings.

    Bad rows (invalid JSON, missing fields) are skipped and counted in one warning, or, with
    `skip_bad_rows=False`, raise a ValueError naming the file and line. A file without a usable row raises
    ValueError.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"jsonl file not found: {path}")
    rows: list[dict] = []
    bad: list[tuple[int, str]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                problem = f"invalid JSON ({e.msg})"
            else:
                problem = _row_problem(row)
            if problem is not None:
                if not skip_bad_rows:
                    raise ValueError(f"{path}:{lineno}: {problem}")
                bad.append((lineno, problem))
                continue
            rows.append({**row, "id": str(row["id"]), "answer": str(row["answer"])})
    if bad:
        shown = "; ".join(f"line {n}: {p}" for n, p in bad[:5]) + (" ..." if len(bad) > 5 else "")
        msg = f"{path}: skipped {len(bad)} bad row(s) ({shown})"
        logger.warning(msg)
        warnings.warn(msg, stacklevel=2)
    if not rows:
        raise ValueError(
            f"{path}: no usable rows" + (f" ({len(bad)} bad)" if bad else " (file is empty)")
            + "; each line must be a JSON object with 'id', 'prompt' or 'messages', and 'answer'"
        )
    return rows
