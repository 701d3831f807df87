"""A safe calculator: parses the expression with `ast` and walks an allow-list of nodes (no eval, no names
other than a few math functions and constants, bounded sizes), with exact rational arithmetic where it can.

    calculate("23 + 17")        -> "40"
    calculate("7/2")            -> "3.5"
    calculate("2^10")           -> "1024"     (^ is power, as on a calculator)
    calculate("sqrt(2)")        -> "1.414213562"
"""

from __future__ import annotations

import ast
import math
import operator
import re
from fractions import Fraction
from typing import Callable, Union

from arl.tools.base import FunctionTool

__all__ = ["calculate", "CalculatorError", "calculator_tool"]

Number = Union[Fraction, float]

MAX_EXPR_CHARS = 256
MAX_INT_DIGITS = 1000  # results larger than this are refused (no 10**10**10)
MAX_NODES = 200


class CalculatorError(ValueError):
    pass


def _check(x: Number) -> Number:
    if isinstance(x, Fraction):
        if max(abs(x.numerator), x.denominator).bit_length() > MAX_INT_DIGITS * 3.33:
            raise CalculatorError("number too large")
    elif not math.isfinite(x):
        raise CalculatorError("result is not finite")
    return x


def _pow(a: Number, b: Number) -> Number:
    if isinstance(b, Fraction) and b.denominator == 1:
        e = int(b)
        if abs(e) > 10_000:
            raise CalculatorError("exponent too large")
        if isinstance(a, Fraction):
            size = max(abs(a.numerator), a.denominator).bit_length()
            if size * abs(e) > MAX_INT_DIGITS * 3.33:
                raise CalculatorError("number too large")
            if a == 0 and e < 0:
                raise CalculatorError("division by zero")
            return a ** e
        return float(a) ** e
    try:
        r = float(a) ** float(b)
    except (OverflowError, ZeroDivisionError) as e:
        raise CalculatorError(str(e)) from None
    if isinstance(r, complex):
        raise CalculatorError("complex result")
    return r


def _nonzero(op: Callable[[Number, Number], Number], what: str = "division") -> Callable[[Number, Number], Number]:
    """`op` refusing a zero right operand with a readable message."""
    def g(a: Number, b: Number) -> Number:
        if b == 0:
            raise CalculatorError(f"{what} by zero")
        return op(a, b)
    return g


_BINOPS: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _nonzero(operator.truediv),
    ast.FloorDiv: _nonzero(lambda a, b: Fraction(math.floor(a / b))), ast.Mod: _nonzero(operator.mod, "modulo"),
    ast.Pow: _pow, ast.BitXor: _pow,
}


def _f(fn: Callable[..., float]) -> Callable[..., Number]:
    def g(*args: Number) -> Number:
        try:
            return float(fn(*(float(a) for a in args)))
        except (ValueError, OverflowError) as e:
            raise CalculatorError(f"{fn.__name__}: {e}") from None
    return g


def _round(x: Number, nd: Number = Fraction(0)) -> Number:
    if isinstance(nd, float) or (isinstance(nd, Fraction) and nd.denominator != 1):
        raise CalculatorError("round() digits must be an integer")
    return Fraction(round(Fraction(x), int(nd)))


_FUNCS: dict[str, Callable[..., Number]] = {
    "sqrt": _f(math.sqrt), "log": _f(math.log), "ln": _f(math.log), "log10": _f(math.log10), "exp": _f(math.exp),
    "sin": _f(math.sin), "cos": _f(math.cos), "tan": _f(math.tan),
    "abs": lambda x: abs(x), "round": _round,
    "floor": lambda x: Fraction(math.floor(x)), "ceil": lambda x: Fraction(math.ceil(x)),
    "min": lambda *a: min(a), "max": lambda *a: max(a),
}
_CONSTS: dict[str, Number] = {"pi": math.pi, "e": math.e}


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, float):
            return Fraction(repr(v))
        if type(v) is int:
            return Fraction(v)
        raise CalculatorError("booleans are not numbers here" if isinstance(v, bool) else f"not a number: {v!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        return v if isinstance(node.op, ast.UAdd) else -v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _check(_BINOPS[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.Name):
        if node.id in _CONSTS:
            return _CONSTS[node.id]
        raise CalculatorError(f"unknown name {node.id!r}")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        fn = _FUNCS.get(node.func.id)
        if fn is None:
            raise CalculatorError(f"unknown function {node.func.id!r}; known: {', '.join(sorted(_FUNCS))}")
        if not node.args:
            raise CalculatorError(f"{node.func.id}() needs an argument")
        try:
            return _check(fn(*(_eval(a) for a in node.args)))
        except TypeError as e:
            raise CalculatorError(f"{node.func.id}: {e}") from None
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def format_number(x: Number) -> str:
    if isinstance(x, Fraction):
        if x.denominator == 1:
            return str(x.numerator)
        x = float(x)
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.10g}"


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly where possible; raises CalculatorError on bad input."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    # "1,000" is a thousands separator (so "max(1,000)" reads as max(1000); write "max(1, 0)")
    expr = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", expression.strip().replace("×", "*").replace("÷", "/"))
    if not expr:
        raise CalculatorError("empty expression")
    if len(expr) > MAX_EXPR_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"syntax error: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError("expression too complex")
    try:
        return format_number(_eval(tree))
    except CalculatorError:
        raise
    except (ArithmeticError, ValueError) as e:
        raise CalculatorError(str(e)) from None


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: numbers with + - * / // % ** (or ^), parentheses, and sqrt, log, exp, abs, round, floor,
            ceil, min, max, pi, e. Example: "(23 + 17) * 3"
    """
    return calculate(expression)


def calculator_tool(timeout: float = 2.0, name: str = "calculator") -> FunctionTool:
    return FunctionTool(calculator, name=name, timeout=timeout)
