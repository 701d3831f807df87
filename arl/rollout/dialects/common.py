"""What every dialect of the endpoint shares: the error it raises, a request as the chat machinery takes it
(`ChatCall`), one generated answer before a dialect writes it out (`Answer`), and server-sent events.

Why one intermediate form: a Responses or Anthropic Messages request is translated into OpenAI chat messages and
goes through the same session (`arl.rollout.sessions.Session.chat_prompt` / `record`), so continuation is token
exact in every dialect by the same code, and an agent may even switch dialect inside one session.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any, Optional

from arl.api.types import SampleOutput
from arl.tools.base import ToolCall

__all__ = ["RequestError", "ChatCall", "Answer", "sse", "new_id", "function_tool", "require", "text_of"]


class RequestError(Exception):
    """A request refused with an error in the dialect's shape (`status`, `code`, the field in `param`)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind

    def openai_body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class ChatCall:
    """A request in chat form. `sampling` holds the dialect's own fields; `names` maps the canonical sampling
    names (temperature, top_p, top_k, n, max_tokens) to the dialect's, so that an error names the field the
    caller sent. `stop`: stop strings (each must be one token)."""

    messages: list[dict]
    tools: Optional[list[dict]]
    parse_tools: bool
    sampling: dict[str, Any]
    names: dict[str, str]
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_param: str = "stop"
    stream: bool = False


@dataclasses.dataclass
class Answer:
    """One generated answer: the engine's sample, its text (the stop string left out), the text outside its tool
    calls, the calls (only when every call block parsed), how it ended ("stop", "length", "abort"), and the stop
    string that ended it if it was one of the request's."""

    sample: SampleOutput
    text: str
    content: str
    calls: list[ToolCall]
    finish: str
    stop: Optional[str] = None

    def message(self, call_ids: Optional[list[str]] = None) -> dict:
        """The assistant message in chat form (what the session compares a continuation with)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if self.calls else self.text}
        if self.calls:
            ids = call_ids or [new_id("call_") for _ in self.calls]
            msg["content"] = self.content or None
            msg["tool_calls"] = [{"id": i, "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for i, c in zip(ids, self.calls)]
        return msg


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def sse(events: list[tuple[Optional[str], dict]], done: bool) -> bytes:
    """Server-sent events: `event:` lines where the dialect names its events, then `data: [DONE]` if asked."""
    out = []
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        out.append(f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n")
    if done:
        out.append("data: [DONE]\n\n")
    return "".join(out).encode("utf-8")


def require(cond: bool, message: str, param: Optional[str]) -> None:
    if not cond:
        raise RequestError(message, param)


def text_of(value: Any, param: str, kinds: tuple[str, ...]) -> str:
    """A string, or a list of text blocks (`{"type": one of kinds, "text": ...}`) joined: other blocks are refused
    by name (images, files, audio: the policy being trained reads text)."""
    if isinstance(value, str):
        return value
    require(isinstance(value, list), f"{param} must be a string or a list of text blocks", param)
    out = []
    for block in value:
        require(isinstance(block, dict) and isinstance(block.get("type"), str), f"{param}: a block must be an object "
                f"with a 'type', got {block!r:.80}", param)
        require(block["type"] in kinds, f"{param}: {block['type']!r} blocks are not supported (text only)", param)
        require(isinstance(block.get("text"), str), f"{param}: a {block['type']} block needs 'text' (a string)", param)
        out.append(block["text"])
    return "".join(out)


def function_tool(name: Any, description: Any, parameters: Any, param: str) -> dict:
    """A tool in the chat API's form (what chat templates and the session's tools key take)."""
    require(isinstance(name, str) and name != "", f"{param}: a tool needs a name (a non-empty string)", param)
    require(description is None or isinstance(description, str), f"{param}: {name}'s description must be a string",
            param)
    require(parameters is None or isinstance(parameters, dict), f"{param}: {name}'s schema must be an object", param)
    fn: dict[str, Any] = {"name": name}
    if description:
        fn["description"] = description
    fn["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}
