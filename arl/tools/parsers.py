"""Tool-call parsers: model text -> tool calls, behind a small interface so formats can be swapped.

The built-in `HermesParser` reads `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the format of
Hermes/Qwen chat templates). Every block that cannot be turned into a call becomes an entry in `errors` (shown
to the model as an error observation); parsing never raises.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Protocol, runtime_checkable

from arl.api.registry import Registry
from arl.tools.base import ToolCall

__all__ = ["ParsedOutput", "ToolCallParser", "HermesParser", "PARSERS", "get_parser"]


@dataclasses.dataclass
class ParsedOutput:
    """`content`: the text outside tool-call blocks; `calls`: well-formed calls in order; `errors`: one message per
    malformed block; `unclosed`: an opening tag without its closing tag (the turn ended inside a call)."""

    content: str
    calls: list[ToolCall] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    unclosed: bool = False

    @property
    def attempted(self) -> bool:
        """The turn tried to call a tool (well-formed or not)."""
        return bool(self.calls or self.errors)


@runtime_checkable
class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedOutput: ...

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        """The text a model should write to make this call (used to build warm-up data)."""


class HermesParser:
    """`<tool_call>{json}</tool_call>`; `arguments` may be an object or a JSON string holding one."""

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>", max_calls: int = 8) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self.max_calls = max_calls
        self._block = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.S)

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        return f"{self.open_tag}{json.dumps({'name': name, 'arguments': arguments})}{self.close_tag}"

    def _one(self, body: str) -> ToolCall | str:
        body = body.strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return f"malformed tool call (invalid JSON: {e.msg} at char {e.pos}): {body[:80]!r}"
        if not isinstance(obj, dict):
            return f"malformed tool call: expected a JSON object, got {type(obj).__name__}"
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return "malformed tool call: missing 'name' (a string)"
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                return f"malformed tool call to {name!r}: 'arguments' is a string that is not JSON"
        if args is None:
            args = {}
        if not isinstance(args, dict):
            return f"malformed tool call to {name!r}: 'arguments' must be an object, got {type(args).__name__}"
        return ToolCall(name=name, arguments=args, raw=body)

    def parse(self, text: str) -> ParsedOutput:
        if not isinstance(text, str):
            return ParsedOutput(content="", errors=[f"expected text, got {type(text).__name__}"])
        out = ParsedOutput(content="")
        pieces: list[str] = []
        pos = 0
        for m in self._block.finditer(text):
            pieces.append(text[pos:m.start()])
            pos = m.end()
            if len(out.calls) + len(out.errors) >= self.max_calls:
                out.errors.append(f"too many tool calls in one turn (at most {self.max_calls}); the rest were ignored")
                break
            one = self._one(m.group(1))
            if isinstance(one, ToolCall):
                out.calls.append(one)
            else:
                out.errors.append(one)
        before, opened, after = text[pos:].partition(self.open_tag)
        pieces.append(before)
        if opened:
            out.unclosed = True
            out.errors.append(f"unclosed {self.open_tag} (no {self.close_tag}): {after.strip()[:80]!r}")
        out.content = "".join(pieces).strip()
        if self.close_tag in out.content:  # a stray closing tag: the model tried a call and garbled it
            out.errors.append(f"stray {self.close_tag} without {self.open_tag}")
            out.content = out.content.replace(self.close_tag, "").strip()
        return out


PARSERS: Registry[Callable[[], ToolCallParser]] = Registry("tool-call parser", "PARSERS.register(name, cls)")
PARSERS.register("hermes", HermesParser)


def get_parser(spec: Any = "hermes") -> ToolCallParser:
    """A parser instance from a name in PARSERS or an object with `parse`."""
    if isinstance(spec, str):
        return PARSERS.get(spec)()
    if not hasattr(spec, "parse"):
        raise TypeError(f"a tool-call parser needs a parse(text) method, got {type(spec).__name__}")
    return spec
