"""calculator: products and sums of large integers, with a tool to compute them.

A model multiplies two 6-digit numbers in its head unreliably; with the `calculate` tool (or, with
`tool = "python"`, the sandboxed Python tool) it gets them right. Reward 1 when the last reply's final number
is the answer; the metric `used_tool` says whether a call succeeded on the way.
"""

from __future__ import annotations

import ast
import operator
import random
from typing import Any, Literal

from tandem.envs.base import Message, Task, metric, reward
from tandem.envs.numbers import extract_final_number
from tandem.envs.sandbox import python_tool
from tandem.envs.synthetic import SyntheticTaskset
from tandem.envs.tool_env import TOOLBOX_KEY, ToolTaskset
from tandem.envs.tools import Tool, ToolError

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_BITS = 13_300
"""About 4,000 decimal digits: the largest integer a step may produce (checked before a power is computed)."""


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers and decimals, + - * / // % ** and parentheses.

    Args:
        expression: the expression, e.g. "123456 * 654321".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"Error: the expression is longer than {MAX_EXPRESSION_CHARS} characters.")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"Error: not an arithmetic expression ({e.msg}).") from None
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        raise ToolError("Error: division by zero.") from None
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    """Numbers and the operators above only (never `eval`); sizes are bounded so no call runs away."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (
            abs(right) > MAX_EXPONENT or (isinstance(left, int) and int(left).bit_length() * abs(right) > MAX_BITS)
        ):
            raise ToolError(
                f"Error: the power is too large (exponents up to {MAX_EXPONENT}, results up to ~4000 digits)."
            )
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > MAX_BITS:
            raise ToolError("Error: the result has more than ~4000 digits.")
        return value
    raise ToolError(f"Error: {ast.unparse(node)!r} is not a number or an arithmetic operation.")


class Calculator(SyntheticTaskset, ToolTaskset):
    """`a * b` or `a + b` with `digits`-digit operands; the tool `calculate` (`tool = "calculator"`: exact
    arithmetic) or `python` (`tool = "python"`: the sandbox)."""

    max_turns = 4
    max_tool_calls = 4

    def __init__(
        self,
        seed: int = 0,
        num_tasks: int | None = None,
        digits: int = 6,
        operations: list[Literal["mul", "add"]] | tuple[str, ...] = ("mul",),
        tool: Literal["calculator", "python"] = "calculator",
    ) -> None:
        super().__init__(seed, num_tasks)
        if not 1 <= digits <= 30:
            raise ValueError(f"digits must be in [1, 30], got {digits}")
        if not operations or not set(operations) <= {"mul", "add"}:
            raise ValueError(f"operations must be a non-empty subset of ['mul', 'add'], got {list(operations)}")
        if tool not in ("calculator", "python"):
            raise ValueError(f"tool must be 'calculator' or 'python', got {tool!r}")
        self.digits, self.operations, self.tool = digits, tuple(operations), tool

    def tools(self) -> list[Tool]:
        return [python_tool() if self.tool == "python" else Tool.from_function(calculate)]

    def make_task(self, idx: int, rng: random.Random) -> Task:
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        op = rng.choice(self.operations)
        symbol, value = ("*", a * b) if op == "mul" else ("+", a + b)
        return Task(
            idx=idx,
            id=f"calculator-{self.seed}-{idx}",
            name=op,
            prompt=(
                f"What is {a} {symbol} {b}? Use the {self.tools()[0].name} tool to compute it exactly, then reply "
                "with the number only."
            ),
            answer=str(value),
        )

    @reward
    def correct(self, completion: str, answer: str) -> float:
        return float(extract_final_number(completion) == answer)

    @metric
    def used_tool(self, state: dict[str, Any], messages: list[Message]) -> float:
        """1 when some call was answered without an error."""
        box = state.get(TOOLBOX_KEY)
        if box is None:
            return 0.0
        answered = sum(m.get("role") == "tool" for m in messages)
        return float(answered > sum(box.stats.errors.values()))
