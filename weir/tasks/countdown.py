"""Countdown (as in TinyZero): reach a target from a few numbers with + - * / and parentheses.

Prompt ``"Using 3 7 25 make 46"``, answer ``"46"``, a solution such as ``"25+3*7"``. Each number
may be used at most once. Responses are evaluated with a restricted `ast` walker, never `eval`.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from fractions import Fraction
from itertools import combinations
from typing import Any

from weir.data.sample import Sample
from weir.rollout.rewards import DEFAULT_EOS_TEXTS, strip_eos

__all__ = [
    "make_rows",
    "sft_rows",
    "solve",
    "safe_eval",
    "extract_expression",
    "countdown_reward",
    "REWARD",
    "DESCRIPTION",
]

REWARD = "weir.tasks.countdown:countdown_reward"
DESCRIPTION = (
    "countdown: combine 3-4 numbers with + - * / to hit a target; prompt 'Using 3 7 25 make 46'"
)
TEST_FRACTION = 0.1
MAX_EXPRESSION_CHARS = 200

_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


# ------------------------------------------------------------------------------ safe evaluation


def safe_eval(expr: str) -> tuple[Fraction, list[int]]:
    """Evaluate an arithmetic expression of integer literals, ``+ - * /`` and parentheses.

    Returns (exact value, the integer literals in order of appearance). Anything else (names,
    calls, attributes, unary operators, powers, floats, strings, ...) raises ValueError, as does
    division by zero. Uses `ast`, never `eval`.
    """
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    numbers: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            op = type(node.op)
            if op is ast.Add:
                return left + right
            if op is ast.Sub:
                return left - right
            if op is ast.Mult:
                return left * right
            if right == 0:
                raise ValueError("division by zero")
            return left / right
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        raise ValueError(
            f"{type(node).__name__} is not allowed (only numbers, + - * / and parentheses)"
        )

    return walk(tree.body), numbers


def extract_expression(text: str, eos_texts: Sequence[str] = DEFAULT_EOS_TEXTS) -> str:
    """The expression in a response: the content of ``<answer>...</answer>`` if present, else the
    last non-empty line; anything from the first ``=`` on is dropped (``"25+3*7=46"``)."""
    text = strip_eos(text, eos_texts)
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    if tagged:
        text = tagged[-1]
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = lines[-1] if lines else ""
    return line.split("=", 1)[0].strip()


# ----------------------------------------------------------------------------------- solving


def solve(numbers: Sequence[int], target: int) -> str | None:
    """An expression using each of `numbers` at most once that equals `target`, or None.

    Exhaustive search over combining pairs (exact fractions), trying subsets of 1, 2, 3, ...
    numbers so the first solution found is among the shortest, and preferring solutions whose
    intermediate results are never negative.
    """
    items = [(Fraction(x), str(x), True) for x in numbers]  # value, text, is_atom
    for allow_negative in (False, True):
        for size in range(1, len(items) + 1):
            for subset in combinations(items, size):
                found = _search(list(subset), Fraction(target), allow_negative)
                if found is not None:
                    return found
    return None


def _search(
    items: list[tuple[Fraction, str, bool]], target: Fraction, allow_negative: bool
) -> str | None:
    if len(items) == 1:
        return items[0][1] if items[0][0] == target else None
    for i in range(len(items)):
        for j in range(len(items)):
            if i == j:
                continue
            (a, ta, atom_a), (b, tb, atom_b) = items[i], items[j]
            rest = [items[k] for k in range(len(items)) if k not in (i, j)]
            pa = ta if atom_a else f"({ta})"
            pb = tb if atom_b else f"({tb})"
            candidates = []
            if i < j:  # commutative ops once per pair
                candidates.append((a + b, f"{ta}+{tb}"))
                candidates.append((a * b, f"{pa}*{pb}"))
            if allow_negative or a >= b:
                candidates.append((a - b, f"{ta}-{pb}"))
            if b != 0:
                candidates.append((a / b, f"{pa}/{pb}"))
            for value, text in candidates:
                found = _search([*rest, (value, text, False)], target, allow_negative)
                if found is not None:
                    return found
    return None


# -------------------------------------------------------------------------------------- data


def _split_of(numbers: Sequence[int], target: int) -> str:
    key = " ".join(map(str, sorted(numbers))) + f"->{target}"
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return "test" if h / 2**64 < TEST_FRACTION else "train"


def _random_target(rng: random.Random, numbers: list[int]) -> Fraction:
    values = [Fraction(x) for x in numbers]
    rng.shuffle(values)
    while len(values) > 1:
        a, b = values.pop(), values.pop()
        op = rng.choice("+-*/")
        if op == "/" and b == 0:
            op = "+"
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
        values.insert(rng.randrange(len(values) + 1), value)
    return values[0]


def make_rows(
    split: str,
    n: int,
    seed: int,
    *,
    min_numbers: int = 3,
    max_numbers: int = 4,
    max_number: int = 99,
    max_target: int = 100,
) -> list[dict[str, Any]]:
    """`n` countdown problems: `min_numbers`..`max_numbers` numbers in 1..`max_number` and a target
    in 1..`max_target` (not itself one of the numbers) that a search proved reachable. Rows: ``{"prompt": "Using 3 7 25 make 46",
    "answer": "46", "numbers": [3, 7, 25], "target": 46, "solution": "25+3*7"}``.

    A problem's split is fixed by a hash of (sorted numbers, target); problems are distinct.
    """
    if split not in ("train", "test"):
        raise ValueError(f"countdown: split must be 'train' or 'test', got {split!r}")
    if not 2 <= min_numbers <= max_numbers:
        raise ValueError("countdown: need 2 <= min_numbers <= max_numbers")
    rng = random.Random(f"countdown:{split}:{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 1000 * (n + 10):
            raise ValueError(
                "countdown: could not generate enough distinct problems; widen the ranges"
            )
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
        value = _random_target(rng, numbers)
        if value.denominator != 1 or not 1 <= value <= max_target:
            continue
        target = int(value)
        if target in numbers:  # trivial: the target is one of the numbers
            continue
        key = (tuple(sorted(numbers)), target)
        if key in seen or _split_of(numbers, target) != split:
            continue
        solution = solve(numbers, target)
        if solution is None:  # cannot happen (the target was built from the numbers); be safe
            continue
        seen.add(key)
        rows.append(
            {
                "prompt": f"Using {' '.join(map(str, numbers))} make {target}",
                "answer": str(target),
                "numbers": numbers,
                "target": target,
                "solution": solution,
                "task": "countdown",
            }
        )
    return rows


def sft_rows(n: int, seed: int, **opts: Any) -> list[dict[str, Any]]:
    """`n` train-split problems with ``"response"`` = a correct solution found by search."""
    rows = make_rows("train", n, seed, **opts)
    for row in rows:
        row["response"] = row["solution"]
    return rows


# ------------------------------------------------------------------------------------ reward

_PROMPT_RE = re.compile(r"Using\s+([\d\s,]+?)\s+make\s+(-?\d+)")


def countdown_reward(
    sample: Sample,
    row: Mapping[str, Any],
    *,
    format_score: float = 0.1,
    answer_key: str = "answer",
    numbers_key: str = "numbers",
    eos_texts: Sequence[str] = DEFAULT_EOS_TEXTS,
) -> dict[str, Any]:
    """1.0 for an expression that uses only the given numbers (each at most once), only
    ``+ - * /`` and parentheses, and equals the target; `format_score` for a well-formed
    expression that breaks a rule or misses the target; 0.0 for anything else.

    The numbers come from ``row[numbers_key]`` or, failing that, from the prompt
    (``"Using 3 7 25 make 46"``). Returns ``{"reward", "expression", "value", "valid_numbers"}``.
    """
    numbers = row.get(numbers_key)
    if numbers is None:
        m = _PROMPT_RE.search(str(row.get("prompt", "")))
        if m is None:
            raise ValueError(
                f"countdown: row has no {numbers_key!r} and its prompt names no numbers"
            )
        numbers = [int(x) for x in re.findall(r"\d+", m.group(1))]
    if answer_key not in row:
        raise ValueError(f"countdown: row has no target field {answer_key!r} (keys: {sorted(row)})")
    target = Fraction(str(row[answer_key]).strip())
    expr = extract_expression(sample.response_text, eos_texts)
    info: dict[str, Any] = {"expression": expr, "value": None, "valid_numbers": False}
    if not expr:
        return {**info, "reward": 0.0}
    try:
        value, used = safe_eval(expr)
    except ValueError as e:
        if "division by zero" in str(e):
            return {**info, "reward": float(format_score)}
        return {**info, "reward": 0.0}
    valid = not (Counter(used) - Counter(int(x) for x in numbers))
    info.update(value=str(value), valid_numbers=valid)
    return {**info, "reward": 1.0 if valid and value == target else float(format_score)}
