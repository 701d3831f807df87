"""Tool-call parsers: model text -> tool calls, behind a small interface so formats can be swapped.

One parser per format of the model families users train first (the name is `rollout.tool_parser`):

- `hermes` (also `qwen3`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the format of the
  Hermes, Qwen2.5 and Qwen3 chat templates (and the tiny model's warm-up);
- `qwen3_coder`: Qwen3-Coder's XML, `<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function>
  </tool_call>`;
- `llama3_json`: Llama 3.1-3.3's JSON tool calls, the whole answer `{"name": ..., "parameters": {...}}` (several
  separated by `;`), optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (Mistral 7B v0.3, Nemo, Small) or, from
  the v11 tokenizers on, `[TOOL_CALLS]NAME[ARGS]{...}` per call.

`parser_for_template(tokenizer)` picks one from the chat template's own markers (`auto`). Every call that cannot be
turned into a call becomes an entry in `errors` (shown to the model as an error observation); parsing never raises.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from arl.api.registry import Registry
from arl.tools.base import ToolCall

__all__ = ["ParsedOutput", "ToolCallParser", "HermesParser", "Qwen3CoderParser", "LlamaJsonParser", "MistralParser",
           "PARSERS", "get_parser", "parser_for_template"]


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


def _call(obj: Any, raw: str) -> ToolCall | str:
    """A decoded `{"name": ..., "arguments" | "parameters": {...}}` as a call, or what is wrong with it."""
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
    return ToolCall(name=name, arguments=args, raw=raw)


def _add(out: ParsedOutput, one: ToolCall | str, max_calls: int) -> bool:
    """Append a call or an error; False once the turn has made `max_calls` (the rest are ignored)."""
    if len(out.calls) + len(out.errors) >= max_calls:
        out.errors.append(f"too many tool calls in one turn (at most {max_calls}); the rest were ignored")
        return False
    (out.calls if isinstance(one, ToolCall) else out.errors).append(one)  # type: ignore[arg-type]
    return True


def _json_values(text: str, sep: str = ";") -> tuple[list[tuple[Any, str]], Optional[str]]:
    """Consecutive JSON values in `text` (whitespace or `sep` between): each with its source, and the error that
    stopped the scan if one did."""
    dec, out, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == sep):
            pos += 1
        if pos >= len(text):
            return out, None
        try:
            obj, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            return out, f"malformed tool call (invalid JSON: {e.msg} at char {e.pos}): {text[pos:pos + 80]!r}"
        out.append((obj, text[pos:end]))
        pos = end


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
        return _call(obj, body)

    def parse(self, text: str) -> ParsedOutput:
        if not isinstance(text, str):
            return ParsedOutput(content="", errors=[f"expected text, got {type(text).__name__}"])
        out = ParsedOutput(content="")
        pieces: list[str] = []
        pos = 0
        for m in self._block.finditer(text):
            pieces.append(text[pos:m.start()])
            pos = m.end()
            if not _add(out, self._one(m.group(1)), self.max_calls):
                break
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


class Qwen3CoderParser(HermesParser):
    """Qwen3-Coder's `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`. A
    value is JSON when it reads as JSON (numbers, booleans, objects, lists), else the text itself: the chat template
    writes strings bare and everything else as JSON."""

    _function = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
    _parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                         for k, v in arguments.items())
        return f"{self.open_tag}\n<function={name}>\n{params}</function>\n{self.close_tag}"

    def _one(self, body: str) -> ToolCall | str:
        m = self._function.match(body)
        if m is None:
            return f"malformed tool call (expected <function=NAME>...</function>): {body.strip()[:80]!r}"
        args: dict[str, Any] = {}
        for key, value in self._parameter.findall(m.group(2)):
            value = value.strip("\n")
            try:
                args[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                args[key.strip()] = value
        return ToolCall(name=m.group(1).strip(), arguments=args, raw=body.strip())


class LlamaJsonParser:
    """Llama 3.x JSON tool calls: the answer is the call(s) `{"name": ..., "parameters": {...}}`, `;`-separated,
    optionally after `<|python_tag|>`. An answer that is not a JSON object with a "name" is plain content (a model
    may answer in JSON); after `<|python_tag|>` anything unreadable is a malformed call."""

    tag = "<|python_tag|>"

    def __init__(self, max_calls: int = 8) -> None:
        self.max_calls = max_calls

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments})

    def parse(self, text: str) -> ParsedOutput:
        if not isinstance(text, str):
            return ParsedOutput(content="", errors=[f"expected text, got {type(text).__name__}"])
        body = text.strip()
        tagged = body.startswith(self.tag)
        body = body[len(self.tag):].strip() if tagged else body
        values, error = _json_values(body)
        looks_like_call = bool(values) and isinstance(values[0][0], dict) and "name" in values[0][0]
        if not tagged and not looks_like_call:
            return ParsedOutput(content=text.strip())
        out = ParsedOutput(content="")
        for obj, raw in values:
            if not _add(out, _call(obj, raw), self.max_calls):
                return out
        if error or not values:
            out.errors.append(error or f"{self.tag} without a JSON tool call")
        return out


class MistralParser:
    """Mistral's `[TOOL_CALLS]`: a JSON list of calls after it (v3 tokenizers), or `NAME[ARGS]{json}` after each
    `[TOOL_CALLS]` (v11 on). The text before the first `[TOOL_CALLS]` is the content."""

    tag, args_tag = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, max_calls: int = 8) -> None:
        self.max_calls = max_calls

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        return self.tag + json.dumps([{"name": name, "arguments": arguments}])

    def parse(self, text: str) -> ParsedOutput:
        if not isinstance(text, str):
            return ParsedOutput(content="", errors=[f"expected text, got {type(text).__name__}"])
        head, *chunks = text.split(self.tag)
        out = ParsedOutput(content=head.strip())
        for chunk in chunks:
            chunk = chunk.strip()
            if chunk.startswith("[") or chunk.startswith("{"):  # v3: a JSON list (or one object) of calls
                values, error = _json_values(chunk)
                for obj, raw in values:
                    for item in obj if isinstance(obj, list) else [obj]:
                        if not _add(out, _call(item, raw), self.max_calls):
                            return out
                if error or not values:
                    out.errors.append(error or f"{self.tag} without a call")
                continue
            name, found, rest = chunk.partition(self.args_tag)  # v11: NAME[ARGS]{...}
            if not found:
                out.errors.append(f"malformed tool call: {self.tag} without {self.args_tag} or a JSON list: "
                                  f"{chunk[:80]!r}")
                continue
            values, error = _json_values(rest)
            one: ToolCall | str = error or "malformed tool call: no JSON arguments"
            if values and not error:
                one = _call({"name": name.strip(), "arguments": values[0][0]}, chunk)
            if not _add(out, one, self.max_calls):
                return out
        return out


PARSERS: Registry[Callable[[], ToolCallParser]] = Registry("tool-call parser", "PARSERS.register(name, cls)")
PARSERS.register("hermes", HermesParser)
PARSERS.register("qwen3", HermesParser)  # Qwen3's chat template writes hermes blocks
PARSERS.register("qwen3_coder", Qwen3CoderParser)
PARSERS.register("llama3_json", LlamaJsonParser)
PARSERS.register("mistral", MistralParser)


def parser_for_template(tokenizer: Any) -> str:
    """The parser a chat template's own markers name (`rollout.tool_parser=auto`); hermes when it names none (the
    tiny model's warm-up writes hermes blocks)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates: read them all
        template = " ".join(str(t) for t in template.values())
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<function=" in template and "<tool_call>" in template:
        return "qwen3_coder"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def get_parser(spec: Any = "hermes") -> ToolCallParser:
    """A parser instance from a name in PARSERS or an object with `parse`."""
    if isinstance(spec, str):
        return PARSERS.get(spec)()
    if not hasattr(spec, "parse"):
        raise TypeError(f"a tool-call parser needs a parse(text) method, got {type(spec).__name__}")
    return spec
