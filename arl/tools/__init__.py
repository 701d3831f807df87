"""Tools for tool-calling agents: declaration (`@tool`, `Tool`), parsers, and the built-in calculator and
sandboxed Python tools (registered as "calculator" and "python")."""

from arl.tools.base import (TOOLS, FunctionTool, Tool, ToolArgumentError, ToolCall, ToolResult, ToolSet, get_tool,
                            register_tool, tool)
from arl.tools.calculator import calculate, calculator_tool
from arl.tools.parsers import PARSERS, HermesParser, ParsedOutput, ToolCallParser, get_parser
from arl.tools.sandbox import PythonSandbox, PythonTool, SandboxResult, sandbox_capabilities

__all__ = ["TOOLS", "FunctionTool", "Tool", "ToolArgumentError", "ToolCall", "ToolResult", "ToolSet", "get_tool",
           "register_tool", "tool", "calculate", "calculator_tool", "PARSERS", "HermesParser", "ParsedOutput",
           "ToolCallParser", "get_parser", "PythonSandbox", "PythonTool", "SandboxResult", "sandbox_capabilities"]
