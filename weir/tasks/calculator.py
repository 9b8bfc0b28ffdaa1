"""Calculator-tool agent: multiplications a tiny model cannot do in its head, and a `calc` tool.

Prompt ``"347*86"``, answer ``"29842"``. An episode (tag tool-call format, weir's tiny template)::

    <|user|>347*86<|end|><|assistant|><calc>347*86</calc><|end|>     model turn 1 (a tool call)
    <|tool|>29842<|end|><|assistant|>                                observation (loss_mask 0)
    29842<|end|>                                                     model turn 2 (the answer)

or, without the tool, a guess ``<|assistant|>29542<|end|>`` (almost always wrong). `sft_rows` mixes
the two (``tool_fraction`` of problems use the tool) so that the warm-started model sometimes calls
the tool and mostly guesses; RL on the exact-match reward of the final turn then raises how often
it calls the tool, and so the success rate. Train and test problems never overlap (split by hash).
Configs: examples/calculator.yaml (the demo), examples/calculator_quick.yaml (CI-sized).
"""

from __future__ import annotations

import ast
import operator
import random
from typing import Any

from weir.rollout.tool_calls import ToolCall, render_tool_calls
from weir.tasks.arithmetic import split_of

__all__ = ["calc", "make_rows", "sft_rows", "tool_episode", "REWARD", "DESCRIPTION", "TOOL_FORMAT"]

REWARD = "exact_match"
DESCRIPTION = "multiplication too hard to do in the head, with a `calc` tool; prompt '347*86'"
TOOL_FORMAT = "tag"
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_DIGITS = 50


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: integers and decimals with + - * / // % and parentheses, e.g. "347*86".
    """
    tree = ast.parse(expression.strip(), mode="eval")
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        v = _BINARY[type(node.op)](_eval(node.left), _eval(node.right))
        if isinstance(v, int) and len(str(abs(v))) > _MAX_DIGITS:
            raise ValueError(f"result has more than {_MAX_DIGITS} digits")
        return v
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def _digits_range(d: int) -> tuple[int, int]:
    """Operands of `d` digits; one-digit operands are 2..9 (x0 and x1 need no calculator)."""
    return (2 if d == 1 else 10 ** (d - 1)), 10**d - 1


def make_rows(
    split: str, n: int, seed: int, *, digits: tuple[int, int] | list[int] = (3, 2)
) -> list[dict[str, Any]]:
    """`n` problems ``a*b`` with `digits` = (digits of a, digits of b). Rows:
    ``{"prompt": "347*86", "answer": "29842", "task": "calculator"}``; distinct within a split
    while its problem space lasts, the same for the same arguments."""
    if split not in ("train", "test"):
        raise ValueError(f"calculator: split must be 'train' or 'test', got {split!r}")
    da, db = (int(x) for x in digits)
    if not (1 <= da <= 9 and 1 <= db <= 9):
        raise ValueError(f"calculator: digits must be two numbers in 1..9, got {digits!r}")
    (lo_a, hi_a), (lo_b, hi_b) = _digits_range(da), _digits_range(db)
    space = (hi_a - lo_a + 1) * (hi_b - lo_b + 1)
    rng = random.Random(f"calculator:{split}:{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(rows) < n:
        a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
        prompt = f"{a}*{b}"
        if split_of(prompt) != split:
            continue
        if prompt in seen and len(seen) < 0.5 * space * (0.1 if split == "test" else 0.9):
            continue  # distinct until half the split's problem space is used
        seen.add(prompt)
        rows.append({"prompt": prompt, "answer": str(a * b), "task": "calculator"})
    return rows


def tool_episode(prompt: str, fmt: str = TOOL_FORMAT) -> tuple[str, str]:
    """The tool-using trajectory's two model turns for `prompt`: the call and the final answer."""
    call = render_tool_calls([ToolCall("calc", {"input": prompt}, id="call_0")], fmt)
    return call, calc(prompt)


def sft_rows(
    n: int,
    seed: int,
    *,
    tool_fraction: float = 0.15,
    digits: tuple[int, int] | list[int] = (3, 2),
    fmt: str = TOOL_FORMAT,
) -> list[dict[str, Any]]:
    """SFT rows from `n` train problems: a ``tool_fraction`` of them (seeded choice) as the tool
    trajectory, two rows each (the call; then, with the call and its result in ``"messages"``, the
    answer), the rest as a direct answer (the model can only learn to guess these)."""
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"calculator: tool_fraction must be in [0, 1], got {tool_fraction}")
    problems = make_rows("train", n, seed, digits=digits)
    use_tool = set(
        random.Random(f"calculator-sft:{seed}").sample(range(n), round(tool_fraction * n))
    )
    rows: list[dict[str, Any]] = []
    for i, p in enumerate(problems):
        if i not in use_tool:
            rows.append({**p, "response": p["answer"], "uses_tool": False})
            continue
        call, result = tool_episode(p["prompt"], fmt)
        rows.append({**p, "response": call, "uses_tool": True})
        chat = [
            {"role": "user", "content": p["prompt"]},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": result},
        ]
        rows.append(
            {"messages": chat, "answer": p["answer"], "response": result, "uses_tool": True}
        )
    return rows
