"""Tools an agent can call: declared with `@tool` (a function) or as a `Tool` subclass, executed async with a timeout.

    @tool(timeout=2.0)
    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first summand
            b: the second summand
        \"\"\"
        return a + b

    add.schema()   # {"type": "function", "function": {"name": "add", "description": ..., "parameters": {...}}}
    await ToolSet([add]).call(ToolCall("add", {"a": 1, "b": 2}))   # ToolResult(content="3", error=False, ...)

The JSON schema comes from the signature (types, defaults) and the docstring (first paragraph = description,
`Args:` lines = parameter descriptions). `ToolSet.call` never raises: an unknown tool, bad arguments, a timeout
or an exception in the tool become a `ToolResult` with `error=True` and a message the model can read.

Sync tools run in a pool of daemon threads (a hung one is written off, it cannot be killed): anything that runs
model-written code must do so in a subprocess (see `arl.tools.sandbox`), never in the worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import re
import time
import types
import typing
from typing import Any, Awaitable, Callable, Optional, Sequence, Union

from arl.api.registry import Registry

__all__ = [
    "Tool", "FunctionTool", "ToolCall", "ToolResult", "ToolSet", "ToolArgumentError", "tool", "register_tool",
    "get_tool", "TOOLS", "json_schema_for",
]


@dataclasses.dataclass
class ToolCall:
    """One parsed call: tool name and JSON arguments (`raw` is the text it was parsed from)."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""


@dataclasses.dataclass
class ToolResult:
    """What a tool call returned. `content` is shown to the model as the observation."""

    name: str
    content: str
    error: bool = False
    seconds: float = 0.0


class ToolArgumentError(ValueError):
    """Arguments that do not match the tool's schema (reported to the model, never raised out of `ToolSet`)."""


# ------------------------------------------------------------------------------------------------- schemas

_JSON_TYPES: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean",
                               list: "array", tuple: "array", dict: "object"}


def json_schema_for(annotation: Any) -> dict[str, Any]:
    """JSON schema of a parameter annotation (str, int, float, bool, list[X], dict, Optional[X], Literal[...])."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return json_schema_for(rest[0]) if len(rest) == 1 else {"anyOf": [json_schema_for(a) for a in rest]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (list, tuple, Sequence):
        sch: dict[str, Any] = {"type": "array"}
        if args and args[0] is not Ellipsis:
            sch["items"] = json_schema_for(args[0])
        return sch
    if origin is dict:
        return {"type": "object"}
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    return {}


def _doc_parts(doc: Optional[str]) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-style docstring."""
    doc = inspect.cleandoc(doc or "")
    if not doc:
        return "", {}
    paragraphs = re.split(r"\n\s*\n", doc)
    description = " ".join(paragraphs[0].split())
    params: dict[str, str] = {}
    m = re.search(r"^(Args|Arguments|Parameters):\s*$(.*?)(?=^\S|\Z)", doc, re.M | re.S)
    if m:
        current = None
        for line in m.group(2).splitlines():
            pm = re.match(r"^\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if pm:
                current = pm.group(1)
                params[current] = pm.group(2).strip()
            elif current and line.strip():
                params[current] += " " + line.strip()
    return description, params


_PY_TYPES: dict[str, Any] = {"integer": int, "number": (int, float), "string": str, "boolean": bool, "array": list,
                             "object": dict}


def _check_type(value: Any, schema: dict[str, Any]) -> bool:
    if "enum" in schema:
        return value in schema["enum"]
    if "anyOf" in schema:
        return any(_check_type(value, s) for s in schema["anyOf"])
    t = schema.get("type")
    if t not in _PY_TYPES:  # no type, or one not checked here
        return True
    if not isinstance(value, _PY_TYPES[t]) or (isinstance(value, bool) and t in ("integer", "number")):
        return False
    return t != "array" or all(_check_type(v, schema.get("items", {})) for v in value)


# -------------------------------------------------------------------------------------------------- tools


class Tool:
    """A callable tool. Subclasses set `name`, `description`, `parameters` (a JSON schema object) and implement
    `run(**arguments)` (sync or async); `timeout` bounds one call in seconds."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
    timeout: float = 10.0

    def schema(self) -> dict[str, Any]:
        """The OpenAI/hermes-style function schema (what a chat template puts in the system prompt)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def validate(self, arguments: Any) -> dict[str, Any]:
        """Check `arguments` against `parameters`; returns them with defaults left to the function."""
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
        props = self.parameters.get("properties", {})
        unknown = sorted(set(arguments) - set(props))
        if unknown and not self.parameters.get("additionalProperties", False):
            raise ToolArgumentError(f"unknown argument(s) {unknown}; {self.name} takes {sorted(props)}")
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            raise ToolArgumentError(f"missing required argument(s) {missing}")
        for k, v in arguments.items():
            sch = props.get(k, {})
            if not _check_type(v, sch):
                want = sch.get("type") or sch.get("enum") or sch.get("anyOf")
                raise ToolArgumentError(f"argument {k!r} must be {want}, got {type(v).__name__} {v!r:.40}")
        return dict(arguments)

    def run(self, **arguments: Any) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class FunctionTool(Tool):
    """A tool made from a function by `@tool`; the schema is derived from its signature and docstring."""

    def __init__(self, fn: Callable[..., Any], *, name: Optional[str] = None, description: Optional[str] = None,
                 timeout: float = 10.0) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        doc_desc, doc_params = _doc_parts(fn.__doc__)
        self.description = description if description is not None else doc_desc
        self.timeout = float(timeout)
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to the raw ones
            hints = {}
        props: dict[str, Any] = {}
        required: list[str] = []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            sch = dict(json_schema_for(hints.get(p.name, p.annotation)))
            if p.name in doc_params:
                sch["description"] = doc_params[p.name]
            if p.default is p.empty:
                required.append(p.name)
            elif p.default is None or isinstance(p.default, (int, float, str, bool)):
                sch["default"] = p.default
            props[p.name] = sch
        self.parameters = {"type": "object", "properties": props, "required": required}

    def run(self, **arguments: Any) -> Any:
        return self.fn(**arguments)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # still callable as the plain function
        return self.fn(*args, **kwargs)


def tool(fn: Optional[Callable[..., Any]] = None, *, name: Optional[str] = None,
         description: Optional[str] = None, timeout: float = 10.0) -> Any:
    """Decorator: `@tool` or `@tool(name=..., timeout=...)` turns a function into a `FunctionTool`."""
    def wrap(f: Callable[..., Any]) -> FunctionTool:
        return FunctionTool(f, name=name, description=description, timeout=timeout)

    return wrap(fn) if fn is not None else wrap


# ------------------------------------------------------------------------------------------------ registry

TOOLS: Registry[Callable[..., Tool]] = Registry("tool", "register_tool(name, factory)")
# the built-ins, imported on first use (their modules import this one)
TOOLS.register_lazy("calculator", "arl.tools.calculator:calculator_tool")
TOOLS.register_lazy("python", "arl.tools.sandbox:PythonTool")


def register_tool(name: str, factory: Callable[..., Tool]) -> Callable[..., Tool]:
    """Register a tool factory (a Tool subclass, or a function returning a Tool) under `name`."""
    return TOOLS.register(name, factory)


def get_tool(spec: Union[str, Tool, dict[str, Any]]) -> Tool:
    """A Tool from a Tool, a registered name, or {"name": registered name, **constructor kwargs}."""
    if isinstance(spec, Tool):
        return spec
    kwargs: dict[str, Any] = {}
    if isinstance(spec, dict):
        kwargs = dict(spec)
        spec = kwargs.pop("name", "")
    t = TOOLS.get(spec)(**kwargs)  # type: ignore[arg-type] - a non-string gets the registry's "unknown tool"
    if not isinstance(t, Tool):
        raise TypeError(f"tool factory {spec!r} returned {type(t).__name__}, not a Tool")
    return t


# ---------------------------------------------------------------------------------------------------- sets

@functools.cache
def _thread_pool() -> Any:
    from arl.envs.math import _DaemonThreadPool

    return _DaemonThreadPool(max_workers=4, hard_cap=64, name="arl-tool")


class ToolSet:
    """The tools one agent may call, by name. `call` never raises (errors become error results)."""

    def __init__(self, tools: Sequence[Union[str, Tool, dict[str, Any]]] = (),
                 default_timeout: Optional[float] = None) -> None:
        self.tools: dict[str, Tool] = {}
        for spec in tools:
            t = get_tool(spec)
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t
        self.default_timeout = default_timeout

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    async def call(self, call: ToolCall) -> ToolResult:
        t0 = time.monotonic()
        t = self.tools.get(call.name)
        if t is None:
            return ToolResult(call.name, f"Error: unknown tool {call.name!r}; available: {', '.join(self.tools)}",
                              True, time.monotonic() - t0)
        try:
            args = t.validate(call.arguments)
        except ToolArgumentError as e:
            return ToolResult(call.name, f"Error: bad arguments for {call.name}: {e}", True, time.monotonic() - t0)
        timeout = self.default_timeout if self.default_timeout is not None else t.timeout
        is_async = inspect.iscoroutinefunction(t.run) or (isinstance(t, FunctionTool)
                                                          and inspect.iscoroutinefunction(t.fn))
        try:
            if is_async:
                out = await asyncio.wait_for(typing.cast(Awaitable[Any], t.run(**args)), timeout)
            else:  # sync tools run in the daemon pool (a hung one is written off)
                out = await _thread_pool().run(functools.partial(t.run, **args), timeout=timeout)
        except asyncio.TimeoutError:
            return ToolResult(call.name, f"Error: {call.name} timed out after {timeout:g}s", True,
                              time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - a failing tool is an observation, not a crash
            return ToolResult(call.name, f"Error: {type(e).__name__}: {e}", True, time.monotonic() - t0)
        if isinstance(out, ToolResult):
            out.seconds = time.monotonic() - t0
            return out
        content = out if isinstance(out, str) else json.dumps(out, default=str)
        return ToolResult(call.name, content, False, time.monotonic() - t0)

    async def call_all(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run several calls concurrently; results in call order."""
        return list(await asyncio.gather(*(self.call(c) for c in calls)))
