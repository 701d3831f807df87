"""describe_error: the message and where it was raised, bounded."""

from __future__ import annotations

from arl.utils.errors import describe_error, exception_text


def _raise_deep(n: int) -> None:
    if n == 0:
        raise ValueError("the reward service is down")
    _raise_deep(n - 1)


def test_the_message_and_the_innermost_frames():
    try:
        _raise_deep(6)
    except ValueError as e:
        text = describe_error(exception_text(e), e)
    lines = text.splitlines()
    assert lines[0] == "ValueError: the reward service is down" and lines[1] == "raised at (innermost last):"
    assert 'raise ValueError("the reward service is down")' in lines[-1]  # where it was raised: last
    assert text.count("in _raise_deep") == 3  # only the last 3 frames


def test_bounded_whatever_the_message_or_the_frames():
    try:
        _raise_deep(3)
    except ValueError as e:
        exc = e
    huge = describe_error("x" * 100_000, exc, frames=50, limit=600)
    assert len(huge) <= 600 and huge.startswith("xxx") and "raise ValueError" in huge
    assert describe_error("no traceback") == "no traceback"
    assert len(describe_error("y" * 5000, limit=300)) == 300
    assert exception_text(KeyError()) == "KeyError"
