"""Tool declaration (schema from signature and docstring), the tool set's error handling, the calculator."""

import asyncio
import time
from typing import Literal, Optional

import pytest

from arl.tools import Tool, ToolCall, ToolSet, calculate, get_tool, tool
from arl.tools.calculator import CalculatorError


@tool(timeout=0.5)
def scale(x: float, factor: int = 2, unit: Optional[str] = None, mode: Literal["a", "b"] = "a") -> float:
    """Multiply a number.

    Args:
        x: the number
        factor: how many times
            (a positive integer)
    """
    return x * factor


@tool
async def slow(seconds: float) -> str:
    """Sleep."""
    await asyncio.sleep(seconds)
    return "done"


@tool(timeout=0.2)
def hang() -> str:
    """Block a thread."""
    time.sleep(1.0)
    return "late"


class Echo(Tool):
    name = "echo"
    description = "Echo the text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    async def run(self, text: str) -> str:
        return text


def test_schema_from_signature_and_docstring():
    s = scale.schema()["function"]
    assert s["name"] == "scale" and s["description"] == "Multiply a number."
    p = s["parameters"]
    assert p["required"] == ["x"]
    assert p["properties"]["x"] == {"type": "number", "description": "the number"}
    assert p["properties"]["factor"] == {"type": "integer", "default": 2,
                                         "description": "how many times (a positive integer)"}
    assert p["properties"]["unit"]["type"] == "string" and p["properties"]["mode"]["enum"] == ["a", "b"]
    assert scale(3, factor=3) == 9  # still a plain function


@pytest.mark.asyncio
async def test_toolset_turns_every_failure_into_an_error_result():
    ts = ToolSet([scale, slow, hang, Echo(), "calculator"])
    assert ts.names() == ["scale", "slow", "hang", "echo", "calculator"]
    ok = await ts.call(ToolCall("scale", {"x": 1.5, "factor": 4}))
    assert (ok.content, ok.error) == ("6.0", False)
    assert (await ts.call(ToolCall("echo", {"text": "hi"}))).content == "hi"
    cases = [
        (ToolCall("nope", {}), "unknown tool 'nope'"),
        (ToolCall("scale", {}), "missing required argument(s) ['x']"),
        (ToolCall("scale", {"x": "1"}), "argument 'x' must be number"),
        (ToolCall("scale", {"x": 1, "factor": True}), "argument 'factor' must be integer"),
        (ToolCall("scale", {"x": 1, "mode": "c"}), "argument 'mode'"),
        (ToolCall("scale", {"x": 1, "y": 2}), "unknown argument(s) ['y']"),
        (ToolCall("calculator", {"expression": "1/0"}), "division by zero"),
    ]
    for c, msg in cases:
        r = await ts.call(c)
        assert r.error and msg in r.content, (c, r.content)
    t0 = time.monotonic()
    r1, r2 = await asyncio.gather(ts.call(ToolCall("hang", {})), ToolSet([slow], default_timeout=0.1).call(
        ToolCall("slow", {"seconds": 5})))
    assert r1.error and "timed out" in r1.content and r2.error and "timed out" in r2.content
    assert time.monotonic() - t0 < 0.9  # neither waited for the tool to finish
    results = await ts.call_all([ToolCall("echo", {"text": "a"}), ToolCall("nope", {}), ToolCall("echo", {"text": "b"})])
    assert [r.content for r in results][::2] == ["a", "b"] and results[1].error


def test_registry():
    assert get_tool("calculator").name == "calculator"
    assert get_tool({"name": "python", "timeout": 1.0}).name == "python"
    with pytest.raises(KeyError, match="registered tools"):
        get_tool("nope")


def test_calculator_is_exact_and_safe():
    assert calculate("23 + 17") == "40"
    assert calculate("7/2") == "3.5"
    assert calculate("0.1 + 0.2") == "0.3"
    assert calculate("2^10") == calculate("2**10") == "1024"
    assert calculate("(3 + 4) * 5 - 6 // 4") == "34"
    assert calculate("sqrt(16) + abs(-2) + max(1, 5)") == "11"
    assert calculate("1,000 * 3") == "3000"
    assert calculate("round(2/3, 2)") == "0.67"
    for bad in ["__import__('os')", "open('x')", "x + 1", "[1, 2]", "1 if 1 else 2", "lambda: 1", "9**9**9",
                "10**100000", "", "a" * 300, "(1).__class__", "1/0", "sqrt(-1)"]:
        with pytest.raises(CalculatorError):
            calculate(bad)
