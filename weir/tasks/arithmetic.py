"""Arithmetic: the bare expression ``"47+85"`` as the prompt, the integer ``"132"`` as the answer.

The tiny model's chat template wraps the prompt; the target response is just the digits and the
model then emits EOS. For a pretrained chat model, `template` words the prompt as a person would
(``"What is {a} {op} {b}? Reply with only the final number."``). Train and test problems never overlap: every problem is assigned to one
split by a hash of its text (a fixed ~10% go to test), independent of seeds and sizes.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

__all__ = ["make_rows", "sft_rows", "corrupt_answer", "split_of", "REWARD", "DESCRIPTION"]

REWARD = "exact_match"
DESCRIPTION = "integer arithmetic on n-digit operands; prompt '47+85', answer '132'"
TEST_FRACTION = 0.1
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_ENUMERATE_LIMIT = 200_000


def split_of(problem: str, test_fraction: float = TEST_FRACTION) -> str:
    """``"test"`` or ``"train"``: a fixed assignment by a hash of the problem text."""
    h = int.from_bytes(hashlib.blake2b(problem.encode(), digest_size=8).digest(), "big")
    return "test" if h / 2**64 < test_fraction else "train"


def _check(split: str, digits: int, min_digits: int | None, ops: str) -> tuple[int, int, str]:
    if split not in ("train", "test"):
        raise ValueError(f"arithmetic: split must be 'train' or 'test', got {split!r}")
    lo_d = digits if min_digits is None else min_digits
    if not 1 <= lo_d <= digits:
        raise ValueError(f"arithmetic: need 1 <= min_digits <= digits, got {lo_d} and {digits}")
    bad = sorted(set(ops) - set(_OPS))
    if not ops or bad:
        raise ValueError(f"arithmetic: ops must be characters of '+-*', got {ops!r}")
    return lo_d, digits, "".join(dict.fromkeys(ops))


def _operand_range(lo_d: int, hi_d: int) -> tuple[int, int]:
    return (0 if lo_d == 1 else 10 ** (lo_d - 1)), 10**hi_d - 1


def _row(a: int, op: str, b: int, template: str | None = None) -> dict[str, Any]:
    prompt = f"{a}{op}{b}" if template is None else template.format(a=a, op=op, b=b)
    return {"prompt": prompt, "answer": str(_OPS[op](a, b)), "task": "arithmetic"}


def make_rows(
    split: str,
    n: int,
    seed: int,
    *,
    digits: int = 2,
    ops: str = "+",
    min_digits: int | None = None,
    template: str | None = None,
) -> list[dict[str, Any]]:
    """`n` problems ``a<op>b`` with operands of `min_digits`..`digits` digits (default exactly
    `digits`; 1-digit operands include 0) and an operator drawn from `ops` (``"+"``, ``"+*"``,
    ``"+-*"``). Rows: ``{"prompt": "47+85", "answer": "132", "task": "arithmetic"}``; with
    `template` (a `str.format` string of ``{a}``, ``{op}``, ``{b}``) the prompt is that string
    filled in. The split of a problem is decided by ``a<op>b`` whatever the template.

    Problems are distinct within a split while the split's problem space lasts, then repeat.
    The same (split, n, seed, options) always gives the same rows.
    """
    lo_d, hi_d, ops = _check(split, digits, min_digits, ops)
    if template is not None:
        try:
            template.format(a=1, op="+", b=2)
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"arithmetic: template {template!r} must use only {{a}}, {{op}} and {{b}}: {err!r}"
            ) from None
    lo, hi = _operand_range(lo_d, hi_d)
    rng = random.Random(f"arithmetic:{split}:{seed}")
    width = hi - lo + 1
    space = len(ops) * width * width
    if space <= _ENUMERATE_LIMIT:
        pool = [
            (a, op, b)
            for op in ops
            for a in range(lo, hi + 1)
            for b in range(lo, hi + 1)
            if split_of(f"{a}{op}{b}") == split
        ]
        if not pool:
            raise ValueError(f"arithmetic: the {split} split of this problem space is empty")
        picks: list[tuple[int, str, int]] = []
        while len(picks) < n:
            picks.extend(rng.sample(pool, min(n - len(picks), len(pool))))
        return [_row(*p, template) for p in picks]
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(rows) < n:
        a, op, b = rng.randint(lo, hi), rng.choice(ops), rng.randint(lo, hi)
        key = f"{a}{op}{b}"
        if key in seen or split_of(key) != split:
            continue
        seen.add(key)
        rows.append(_row(a, op, b, template))
    return rows


def corrupt_answer(answer: str) -> str:
    """The systematic error used for corrupted SFT targets: the last digit plus one (mod 10)."""
    return answer[:-1] + str((int(answer[-1]) + 1) % 10)


def sft_rows(n: int, seed: int, *, corrupt: float = 0.0, **difficulty: Any) -> list[dict[str, Any]]:
    """`n` train-split rows with ``"response"`` = the answer (EOS is the trainer's to append).

    ``corrupt=f`` makes exactly ``round(f * n)`` targets wrong by one fixed rule
    (`corrupt_answer`: last digit + 1), chosen by a seeded RNG, not by problem content; those
    rows carry ``"corrupted": True`` and keep the true ``"answer"``. A policy warm-started on them
    is weak under greedy decoding while sampling still finds correct answers.
    """
    if not 0.0 <= corrupt <= 1.0:
        raise ValueError(f"arithmetic: corrupt must be in [0, 1], got {corrupt}")
    rows = make_rows("train", n, seed, **difficulty)
    bad = set(random.Random(f"arithmetic-corrupt:{seed}").sample(range(n), round(corrupt * n)))
    for i, row in enumerate(rows):
        row["corrupted"] = i in bad
        row["response"] = corrupt_answer(row["answer"]) if i in bad else row["answer"]
    return rows
