"""Anthropic's Messages API (`POST /v1/messages`) as chat: `system`, `messages` with text / `tool_use` /
`tool_result` blocks, `tools` with `input_schema`, `max_tokens` (required, as Anthropic's), `stop_sequences` (each one token, as `stop` in chat), `stream` (message_start,
content_block_start / delta / stop, message_delta, message_stop) and Anthropic's error shape. The sampling
fields of API versions before the 2.x SDKs (`temperature` 0-1, `top_p`, `top_k`) are honoured when sent; the SDK
no longer sends them, so the run's sampling settings apply. Hints that do not change what is generated
(`cache_control`, `speed`, `inference_geo`, `metadata`, ...) are accepted and ignored. The session key
comes as `x-api-key` (the SDK's header).

An assistant message's text and `tool_use` blocks, sent back, become the assistant message the answer was in
chat form (`tool_use.input` compared as the call's arguments), so the session continues the exact ids.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from arl.rollout.dialects.common import Answer, ChatCall, RequestError, function_tool, new_id, require, text_of

__all__ = ["FIELDS", "chat_call", "message", "events", "error_body"]

FIELDS = {"model", "max_tokens", "messages", "system", "tools", "tool_choice", "temperature", "top_p", "top_k",
          "stop_sequences", "stream", "metadata", "thinking", "service_tier", "output_config", "container",
          "cache_control", "speed", "inference_geo", "diagnostics", "user_profile_id", "workspace_id"}
NAMES = {"max_tokens": "max_tokens", "top_k": "top_k"}
_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
           404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error"}
_STOP = {"stop": "end_turn", "length": "max_tokens", "abort": "pause_turn"}


def error_body(e: RequestError) -> dict:
    return {"type": "error", "error": {"type": _ERRORS.get(e.status, "api_error"), "message": str(e)}}


def _user(blocks: list, where: str) -> list[dict]:
    out: list[dict] = []
    for b in blocks:
        require(isinstance(b, dict), f"{where}: a content block must be an object", "messages")
        kind = b.get("type")
        if kind == "text":
            require(isinstance(b.get("text"), str), f"{where}: a text block needs 'text'", "messages")
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += b["text"]
            else:
                out.append({"role": "user", "content": b["text"]})
        elif kind == "tool_result":
            require(isinstance(b.get("tool_use_id"), str), f"{where}: a tool_result needs tool_use_id", "messages")
            content = b.get("content", "")
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                        "content": text_of(content, "messages", ("text",)) if content is not None else ""})
        else:
            raise RequestError(f"{where}: {kind!r} blocks are not supported in user messages (text and tool_result)",
                               "messages")
    return out


def _assistant(blocks: list, where: str) -> dict:
    text, calls = [], []
    for b in blocks:
        require(isinstance(b, dict), f"{where}: a content block must be an object", "messages")
        kind = b.get("type")
        if kind == "text":
            require(isinstance(b.get("text"), str), f"{where}: a text block needs 'text'", "messages")
            text.append(b["text"])
        elif kind == "tool_use":
            require(isinstance(b.get("name"), str) and isinstance(b.get("input"), dict),
                    f"{where}: a tool_use block needs name and input (an object)", "messages")
            calls.append({"id": str(b.get("id", "")), "type": "function",
                          "function": {"name": b["name"], "arguments": b["input"]}})
        else:
            raise RequestError(f"{where}: {kind!r} blocks are not supported in assistant messages (text and "
                               "tool_use)", "messages")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(body: dict) -> list[dict]:
    system = body.get("system")
    out = [{"role": "system", "content": text_of(system, "system", ("text",))}] if system else []
    messages = body.get("messages")
    require(isinstance(messages, list) and messages != [], "messages must be a non-empty list", "messages")
    for k, m in enumerate(messages):
        where = f"messages.{k}"
        require(isinstance(m, dict) and m.get("role") in ("user", "assistant"),
                f"{where}: a message must be an object with role 'user' or 'assistant'", "messages")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        require(isinstance(blocks, list), f"{where}.content must be a string or a list of blocks", "messages")
        if m["role"] == "user":
            out.extend(_user(blocks, where))
        else:
            out.append(_assistant(blocks, where))
    require(messages[-1].get("role") == "user", "the last message must be the user's (an assistant prefill cannot "
            "be continued token-exactly)", "messages")
    return out


def _tools(body: dict) -> tuple[Optional[list[dict]], bool]:
    tools = body.get("tools")
    out = None
    if tools:
        require(isinstance(tools, list), "tools must be a list", "tools")
        out = []
        for t in tools:
            require(isinstance(t, dict), "tools: each tool must be an object", "tools")
            require(t.get("type") in (None, "custom"), f"tools: server tools ({t.get('type')!r}) are not supported "
                    "(custom tools only: the agent runs its tools)", "tools")
            out.append(function_tool(t.get("name"), t.get("description"), t.get("input_schema"), "tools"))
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    require(choice is None or (isinstance(choice, dict) and kind in ("auto", "none")), "tool_choice: only "
            "{'type': 'auto'} or {'type': 'none'} (a forced tool cannot be honoured by sampling)", "tool_choice")
    require(not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use")),
            "tool_choice.disable_parallel_tool_use is not supported (the model may write several calls)",
            "tool_choice")
    return out, bool(out) and kind != "none"


def chat_call(body: dict) -> ChatCall:
    require(isinstance(body.get("model"), str), "model: a string is required", "model")
    max_tokens = body.get("max_tokens")
    require(isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1,
            f"max_tokens: an integer >= 1 is required, got {max_tokens!r}", "max_tokens")
    t = body.get("temperature")
    require(t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= 1),
            f"temperature must be a number in [0, 1], got {t!r}", "temperature")
    for name in ("container", "diagnostics"):
        require(body.get(name) is None, f"{name} is not supported", name)
    output = body.get("output_config")
    require(output is None or (isinstance(output, dict) and not any(output.values())), "output_config is not "
            "supported (structured output and effort cannot be honoured by sampling)", "output_config")
    thinking = body.get("thinking")
    require(thinking is None or (isinstance(thinking, dict) and thinking.get("type") == "disabled"),
            "thinking is not supported (only {'type': 'disabled'})", "thinking")
    stops = body.get("stop_sequences") or []
    require(isinstance(stops, list) and len(stops) <= 4 and all(isinstance(s, str) and s for s in stops),
            "stop_sequences must be a list of at most 4 non-empty strings", "stop_sequences")
    stream = body.get("stream")
    require(stream is None or isinstance(stream, bool), "stream must be a boolean", "stream")
    tools, parse = _tools(body)
    return ChatCall(_messages(body), tools, parse, body, NAMES, stop=list(stops), stop_param="stop_sequences",
                    stream=bool(stream))


def message(answer: Answer, msg: dict, prompt_len: int, model: str) -> dict:
    """The Message object of one answer (`msg`: the answer in chat form, with the call ids it was given)."""
    content: list[dict] = []
    text = msg.get("content") or ""
    if not answer.calls or text:
        content.append({"type": "text", "text": text})
    for c in msg.get("tool_calls", []):
        content.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])})
    reason = "tool_use" if answer.calls and answer.finish == "stop" else _STOP[answer.finish]
    if answer.stop is not None and not answer.calls:
        reason = "stop_sequence"
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": answer.stop if reason == "stop_sequence" else None,
            "usage": {"input_tokens": prompt_len, "output_tokens": len(answer.sample.output_ids),
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
            "arl": {"token_ids": answer.sample.output_ids.tolist(),
                    "versions": answer.sample.output_versions.tolist()}}


def events(result: dict) -> list[tuple[str, dict]]:
    """A finished message as Anthropic's event stream: each block's whole text (or input JSON) in one delta."""
    out: list[tuple[str, dict]] = []

    def emit(kind: str, **data: Any) -> None:
        out.append((kind, {"type": kind, **data}))

    emit("message_start", message=result | {"content": [], "stop_reason": None, "stop_sequence": None,
                                            "usage": result["usage"] | {"output_tokens": 0}})
    for i, block in enumerate(result["content"]):
        if block["type"] == "text":
            emit("content_block_start", index=i, content_block={"type": "text", "text": ""})
            emit("content_block_delta", index=i, delta={"type": "text_delta", "text": block["text"]})
        else:
            emit("content_block_start", index=i, content_block=block | {"input": {}})
            emit("content_block_delta", index=i, delta={"type": "input_json_delta",
                                                        "partial_json": json.dumps(block["input"])})
        emit("content_block_stop", index=i)
    emit("message_delta", delta={"stop_reason": result["stop_reason"], "stop_sequence": result["stop_sequence"]},
         usage={"output_tokens": result["usage"]["output_tokens"]})
    emit("message_stop")
    return out
