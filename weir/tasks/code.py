"""Synthetic code task: write a one-line Python function from a short spec; hidden tests check it.

Prompt ``"add 3 then mul 2"``, answer ``"def f(x): return (x+3)*2"``, and four hidden tests
(``assert f(4) == 14`` ...) that the `code_tests` reward runs in the sandbox (reward = fraction passed).
The spec applies two operations to ``x`` in order; where an addition or subtraction is followed by a
multiplication the expression needs parentheses, the classic precedence bug. ``parens_fraction`` of
the problems are of that kind.

`sft_rows` with ``corrupt=f`` writes ``f`` of the targets without the parentheses (a systematic bug;
only the problems that need them change), so the warm-started model writes buggy code for half the
problems under greedy decoding but sometimes the right code when sampling: running the hidden tests
(GRPO on their pass fraction) teaches it the parentheses. The tiny model's byte-level tokenizer
writes any Python; a program is ~23 tokens. Train and test problems never overlap (30% of the 729
specs are test problems, by hash).
Config: examples/code.yaml (the demo).
"""

from __future__ import annotations

import random
from typing import Any

from weir.tasks.arithmetic import split_of

__all__ = [
    "make_rows",
    "sft_rows",
    "solution",
    "buggy_solution",
    "hidden_tests",
    "REWARD",
    "DESCRIPTION",
]

REWARD = "code_tests"
DESCRIPTION = (
    "write a one-line Python function from a spec ('add 3 then mul 2'), run against hidden tests"
)
OPS = {"add": "+", "sub": "-", "mul": "*"}
CONSTANTS = range(1, 10)
TEST_FRACTION = 0.3  # of the 729 specs; the rule to learn (parentheses) carries over to them
TEST_INPUTS = range(-5, 10)
N_TESTS = 4


def _parse(spec: str) -> list[tuple[str, int]]:
    words = spec.replace(" then ", " ").split()
    return [(words[i], int(words[i + 1])) for i in range(0, len(words), 2)]


def _expr(spec: str, parens: bool) -> str:
    expr, last = "x", None
    for op, k in _parse(spec):
        if parens and op == "mul" and last in ("add", "sub"):
            expr = f"({expr})"
        expr, last = f"{expr}{OPS[op]}{k}", op
    return expr


def solution(spec: str) -> str:
    """The correct one-line function for `spec`."""
    return f"def f(x): return {_expr(spec, parens=True)}"


def buggy_solution(spec: str) -> str:
    """The function without the parentheses precedence needs (equal to `solution` where none are)."""
    return f"def f(x): return {_expr(spec, parens=False)}"


def _value(spec: str, x: int) -> int:
    for op, k in _parse(spec):
        x = x + k if op == "add" else x - k if op == "sub" else x * k
    return x


def needs_parens(spec: str) -> bool:
    return solution(spec) != buggy_solution(spec)


def hidden_tests(spec: str) -> list[str]:
    """`N_TESTS` asserts on inputs chosen by a hash of the spec (the same for every run)."""
    xs = random.Random(f"code-tests:{spec}").sample(list(TEST_INPUTS), N_TESTS)
    return [f"assert f({x}) == {_value(spec, x)}" for x in xs]


def _pool(split: str, max_constant: int = 9) -> tuple[list[str], list[str]]:
    """All two-step specs of `split` with constants 1..`max_constant`: (those needing parentheses,
    the others)."""
    plain, paren = [], []
    ks = [k for k in CONSTANTS if k <= max_constant]
    for a in OPS:
        for ka in ks:
            for b in OPS:
                for kb in ks:
                    spec = f"{a} {ka} then {b} {kb}"
                    if split_of(spec, TEST_FRACTION) == split:
                        (paren if needs_parens(spec) else plain).append(spec)
    return paren, plain


def _row(spec: str) -> dict[str, Any]:
    return {"prompt": spec, "answer": solution(spec), "tests": hidden_tests(spec), "task": "code"}


def make_rows(
    split: str, n: int, seed: int, *, parens_fraction: float = 0.5, max_constant: int = 9
) -> list[dict[str, Any]]:
    """`n` problems with constants 1..`max_constant` (fewer make a smaller task, learnt sooner); each
    needs parentheses with probability `parens_fraction`. Rows:
    ``{"prompt", "answer" (the reference solution), "tests" (hidden asserts), "task": "code"}``.
    Distinct within a split while its problems last; the same for the same arguments."""
    if split not in ("train", "test"):
        raise ValueError(f"code: split must be 'train' or 'test', got {split!r}")
    if not 0.0 <= parens_fraction <= 1.0:
        raise ValueError(f"code: parens_fraction must be in [0, 1], got {parens_fraction}")
    if not 1 <= max_constant <= 9:
        raise ValueError(f"code: max_constant must be in 1..9, got {max_constant}")
    rng = random.Random(f"code:{split}:{seed}")
    pools = [list(p) for p in _pool(split, max_constant)]
    for p in pools:
        rng.shuffle(p)
    used = [0, 0]
    rows = []
    for _ in range(n):
        kind = 0 if rng.random() < parens_fraction else 1
        spec = pools[kind][used[kind] % len(pools[kind])]
        used[kind] += 1
        rows.append(_row(spec))
    return rows


def sft_rows(
    n: int, seed: int, *, corrupt: float = 0.0, parens_fraction: float = 0.5, max_constant: int = 9
) -> list[dict[str, Any]]:
    """`n` train rows with ``"response"`` = the solution, or for ``round(corrupt * n)`` rows (seeded
    choice, not by content) the buggy solution without parentheses; those rows carry
    ``"corrupted": True``."""
    if not 0.0 <= corrupt <= 1.0:
        raise ValueError(f"code: corrupt must be in [0, 1], got {corrupt}")
    rows = make_rows("train", n, seed, parens_fraction=parens_fraction, max_constant=max_constant)
    bad = set(random.Random(f"code-corrupt:{seed}").sample(range(n), round(corrupt * n)))
    for i, row in enumerate(rows):
        row["corrupted"] = i in bad
        row["response"] = buggy_solution(row["prompt"]) if i in bad else row["answer"]
    return rows
