"""OpenAI's Responses API (`POST /v1/responses`) as chat: `input` (a string or items: messages,
`function_call`, `function_call_output`), `instructions`, function `tools`, `max_output_tokens`, `temperature`,
`top_p`, `stream` (the Responses event stream) and `previous_response_id` within one session.

A response's output items, sent back as input (the Agents SDK's way) or named by `previous_response_id`, become
the assistant message that answer was in chat form, so the session continues the exact ids either way. As the
real API, `instructions` of an earlier response are not carried over by `previous_response_id`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from arl.rollout.dialects.common import Answer, ChatCall, RequestError, function_tool, new_id, require, text_of

__all__ = ["FIELDS", "chat_call", "response", "events"]

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
          "temperature", "top_p", "stream", "stream_options", "previous_response_id", "store", "metadata", "user",
          "truncation", "include", "text", "reasoning", "service_tier", "prompt_cache_key", "safety_identifier",
          "top_logprobs", "background", "max_tool_calls", "prompt_cache_retention"}
NAMES = {"max_tokens": "max_output_tokens"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_LOGPROBS = "message.output_text.logprobs"


def _refuse_unhonoured(body: dict) -> None:
    if body.get("background"):
        raise RequestError("background responses are not supported (answer in the request)", "background")
    if body.get("truncation") not in (None, "disabled"):
        raise RequestError("truncation: only 'disabled' (the policy's context is never cut silently)", "truncation")
    include = body.get("include") or []
    require(isinstance(include, list), "include must be a list", "include")
    for item in include:
        require(item == _LOGPROBS, f"include {item!r} is not supported (only {_LOGPROBS!r})", "include")
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        require(isinstance(text, dict) and (fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text")),
                "text.format: only {'type': 'text'} is supported (structured output cannot be honoured by sampling)",
                "text")
    reasoning = body.get("reasoning")
    require(reasoning is None or (isinstance(reasoning, dict) and not any(reasoning.values())),
            "reasoning options are not supported (the policy is not a reasoning model of this API)", "reasoning")
    require(body.get("top_logprobs") in (None, 0), "top_logprobs is not supported (the sampled token's logprob "
            f"only: include {_LOGPROBS!r})", "top_logprobs")
    require(body.get("max_tool_calls") is None, "max_tool_calls is not supported", "max_tool_calls")
    require(body.get("parallel_tool_calls") is not False, "parallel_tool_calls=false is not supported (the model "
            "may write several calls)", "parallel_tool_calls")


def _tools(body: dict) -> tuple[Optional[list[dict]], bool]:
    tools = body.get("tools")
    if not tools:
        tools = None
    else:
        require(isinstance(tools, list), "tools must be a list", "tools")
        out = []
        for t in tools:
            require(isinstance(t, dict), "tools: each tool must be an object", "tools")
            require(t.get("type") == "function", f"tools: {t.get('type')!r} tools are not supported (function "
                    "tools only: the agent runs its tools)", "tools")
            out.append(function_tool(t.get("name"), t.get("description"), t.get("parameters"), "tools"))
        tools = out
    choice = body.get("tool_choice")
    require(choice in (None, "auto", "none"), "tool_choice must be 'auto' or 'none' (a forced tool cannot be "
            "honoured by sampling)", "tool_choice")
    return tools, bool(tools) and choice != "none"


def _messages(items: Any) -> list[dict]:
    """Input items as chat messages: function calls join the assistant message before them (one turn's output
    is its message item, then its function_call items), outputs become tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    require(isinstance(items, list) and items != [], "input must be a non-empty string or list of items", "input")
    out: list[dict] = []
    for k, item in enumerate(items):
        where = f"input[{k}]"
        require(isinstance(item, dict), f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            require(role in ("user", "assistant", "system", "developer"), f"{where}.role must be user, assistant, "
                    f"system or developer, got {role!r:.40}", "input")
            text = text_of(item.get("content"), "input", _TEXT_PARTS)
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            require(isinstance(name, str) and isinstance(args, str) and isinstance(call_id, str),
                    f"{where}: a function_call needs name, arguments (a JSON string) and call_id", "input")
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            require(isinstance(call_id, str), f"{where}: a function_call_output needs call_id", "input")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": text_of(item.get("output"), "input", _TEXT_PARTS)})
        else:
            raise RequestError(f"{where}: input items of type {kind!r} are not supported (messages, function_call "
                               "and function_call_output)", "input")
    return out


def chat_call(body: dict, previous: Callable[[str], Optional[list[dict]]]) -> tuple[ChatCall, list[dict]]:
    """The request in chat form, and its conversation without instructions (what a later `previous_response_id`
    continues from, with this response's answer appended)."""
    _refuse_unhonoured(body)
    tools, parse = _tools(body)
    conversation = _messages(body.get("input"))
    prev_id = body.get("previous_response_id")
    if prev_id is not None:
        require(isinstance(prev_id, str), "previous_response_id must be a string", "previous_response_id")
        earlier = previous(prev_id)
        if earlier is None:
            raise RequestError(f"previous response with id {prev_id!r} not found (in this session)",
                               "previous_response_id", code="previous_response_not_found")
        conversation = earlier + conversation
    instructions = body.get("instructions")
    require(instructions is None or isinstance(instructions, str), "instructions must be a string", "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    stream = body.get("stream")
    require(stream is None or isinstance(stream, bool), "stream must be a boolean", "stream")
    return ChatCall(messages, tools, parse, body, NAMES, stream=bool(stream)), conversation


def _output(answer: Answer, msg: dict, logprobs: Optional[list[dict]]) -> list[dict]:
    out: list[dict] = []
    text = msg.get("content") or ""
    if not answer.calls or text:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        out.append({"type": "message", "id": new_id("msg_"), "status": "completed", "role": "assistant",
                    "content": [part]})
    for c in msg.get("tool_calls", []):
        out.append({"type": "function_call", "id": new_id("fc_"), "call_id": c["id"], "name": c["function"]["name"],
                    "arguments": c["function"]["arguments"], "status": "completed"})
    return out


def response(answer: Answer, msg: dict, body: dict, prompt_len: int, model: str,
             logprobs: Optional[list[dict]]) -> dict:
    """The Response object of one answer (`msg`: the answer in chat form, with the call ids it was given)."""
    status, incomplete, error = "completed", None, None
    if answer.finish == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    elif answer.finish == "abort":
        status, error = "failed", {"code": "server_error", "message": "the engine aborted the request"}
    n_out = len(answer.sample.output_ids)
    return {"id": new_id("resp_"), "object": "response", "created_at": int(time.time()), "status": status,
            "error": error, "incomplete_details": incomplete, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": model,
            "output": _output(answer, msg, logprobs), "parallel_tool_calls": True,
            "previous_response_id": body.get("previous_response_id"), "reasoning": None,
            "store": body.get("store", True), "temperature": body.get("temperature"),
            "text": {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": "disabled",
            "usage": {"input_tokens": prompt_len, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt_len + n_out},
            "user": body.get("user"), "metadata": body.get("metadata") or {},
            "arl": {"token_ids": answer.sample.output_ids.tolist(), "versions": answer.sample.output_versions.tolist()}}


def events(result: dict) -> list[tuple[str, dict]]:
    """The Responses event stream of a finished response: created, in progress, each output item added, its
    text or arguments as one delta, done, then completed (or incomplete / failed)."""
    out: list[tuple[str, dict]] = []

    def emit(kind: str, **data: Any) -> None:
        out.append((kind, {"type": kind, "sequence_number": len(out), **data}))

    start = result | {"status": "in_progress", "output": [], "usage": None, "error": None, "incomplete_details": None}
    emit("response.created", response=start)
    emit("response.in_progress", response=start)
    for i, item in enumerate(result["output"]):
        if item["type"] == "message":
            emit("response.output_item.added", output_index=i, item=item | {"status": "in_progress", "content": []})
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": i, "content_index": 0}
            emit("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []})
            emit("response.output_text.delta", **where, delta=part["text"], logprobs=part.get("logprobs", []))
            emit("response.output_text.done", **where, text=part["text"], logprobs=part.get("logprobs", []))
            emit("response.content_part.done", **where, part=part)
        else:
            emit("response.output_item.added", output_index=i, item=item | {"status": "in_progress", "arguments": ""})
            where = {"item_id": item["id"], "output_index": i}
            emit("response.function_call_arguments.delta", **where, delta=item["arguments"])
            emit("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=i, item=item)
    final = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(result["status"],
                                                                                          "response.failed")
    emit(final, response=result)
    return out

