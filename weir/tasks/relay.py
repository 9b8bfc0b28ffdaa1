"""Relay: a two-role arithmetic task where each role computes a part the other needs.

A row is ``3+4+5``. The ``first`` role adds the first two numbers (``7``); the ``second`` role sees
the problem and ``first: 7`` and adds the third number to *first's* result (``12``). The team's
answer is the second's line, so the team is right only when both parts are right:

    team   = [second's line == a + b + c]
    first  = [first's line == a + b]
    second = [second's line == int(first's line) + c]      (right given what first said)

This is cooperation a tiny model can learn on a CPU: unlike a checker that has to verify a result
it cannot compute, each role has a small skill of its own (one-digit sums; a sum up to 18 plus a
digit), and the team outcome is the product of both. SFT teaches the second to build on first's
line, right or wrong (it is shown corrupted lines too), so a wrong first sinks the team whatever
the second does. The second does see the whole problem; it is trained to relay, not to recompute.

SFT makes both roles weak in a way RL can fix (the arithmetic demo's recipe): a `corrupt` fraction
of each role's targets has the last digit off by one. Configs: examples/relay.yaml (the demo) and
examples/relay_quick.yaml (CI-sized); docs/multi-agent.md.
"""

from __future__ import annotations

import random
from typing import Any

from weir.rollout.multi_agent import opening_messages, turn_line
from weir.rollout.roles import Episode
from weir.tasks.arithmetic import corrupt_answer, split_of

__all__ = ["make_rows", "sft_rows", "score", "FIRST", "SECOND", "PROMPTS", "REWARD"]

REWARD = "exact_match"  # unused when multi_agent.scorer is this module's `score`
DESCRIPTION = "first adds a+b, second adds c to first's result (two roles relay, one policy)"
FIRST, SECOND = "first", "second"
PROMPTS = {FIRST: "add a+b", SECOND: "add c to first"}


def _problems(split: str, digits: int) -> list[tuple[int, int, int]]:
    if split not in ("train", "test"):
        raise ValueError(f"relay: split must be 'train' or 'test', got {split!r}")
    if digits not in (1, 2):
        raise ValueError(f"relay: digits must be 1 or 2, got {digits}")
    hi = 10**digits
    return [
        (a, b, c)
        for a in range(hi)
        for b in range(hi)
        for c in range(10)
        if split_of(f"{a}+{b}+{c}") == split
    ]


def _row(a: int, b: int, c: int) -> dict[str, Any]:
    return {
        "prompt": f"{a}+{b}+{c}",
        "answer": str(a + b + c),
        "first_answer": str(a + b),
        "last": c,
        "task": "relay",
    }


def make_rows(split: str, n: int, seed: int, *, digits: int = 1) -> list[dict[str, Any]]:
    """`n` problems ``a+b+c`` (a, b with `digits` digits, c one digit), rows
    ``{"prompt": "3+4+5", "answer": "12", "first_answer": "7", "last": 5}``. Train and test never
    share a problem (`weir.tasks.arithmetic.split_of` on the text); problems are distinct while the
    split lasts, then repeat; same arguments, same rows."""
    pool = _problems(split, digits)
    rng = random.Random(f"relay:{split}:{seed}")
    picks: list[tuple[int, int, int]] = []
    while len(picks) < n:
        picks.extend(rng.sample(pool, min(n - len(picks), len(pool))))
    return [_row(*p) for p in picks]


def _int(text: str | None) -> int | None:
    word = (text or "").strip()
    return int(word) if word.isdigit() else None


def score(episode: Episode, row: dict) -> dict[str, float]:
    """team = the second's line is a+b+c; first = its line is a+b; second = its line is first's
    number plus c (0 when first said no number: there was nothing to build on)."""
    said_first = _int(episode.last(FIRST))
    said_second = _int(episode.last(SECOND))
    relayed = said_first is not None and said_second == said_first + int(row["last"])
    return {
        "team": float(said_second is not None and str(said_second) == row["answer"]),
        FIRST: float(said_first is not None and str(said_first) == row["first_answer"]),
        SECOND: float(relayed),
    }


def sft_rows(
    n: int, seed: int, *, corrupt: float = 0.6, wrong_lines: float = 0.5, digits: int = 1
) -> list[dict[str, Any]]:
    """`2n` SFT rows: `n` turns of first (target a+b) and `n` of second (shown ``first: x`` with
    x = a+b, or a+b with its last digit off by one for a `wrong_lines` fraction; target x+c).
    A `corrupt` fraction of each role's targets is off by one in the last digit. Each row's
    ``messages`` is the chat the role sees in an episode (`opening_messages`), so SFT and RL
    prompts are the same tokens."""
    for name, v in (("corrupt", corrupt), ("wrong_lines", wrong_lines)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"relay: {name} must be in [0, 1], got {v}")
    rng = random.Random(f"relay-sft:{seed}")

    def target(answer: int) -> str:
        return corrupt_answer(str(answer)) if rng.random() < corrupt else str(answer)

    rows: list[dict[str, Any]] = []
    for r in make_rows("train", n, seed, digits=digits):
        problem = {"prompt": r["prompt"]}
        rows.append(
            {
                "messages": opening_messages(problem, PROMPTS[FIRST], []),
                "response": target(int(r["first_answer"])),
                "role": FIRST,
            }
        )
    for r in make_rows("train", n, seed + 1, digits=digits):
        line = r["first_answer"]
        if rng.random() < wrong_lines:
            line = corrupt_answer(line)
        rows.append(
            {
                "messages": opening_messages(
                    {"prompt": r["prompt"]}, PROMPTS[SECOND], [turn_line(FIRST, line)]
                ),
                "response": target(int(line) + r["last"]),
                "role": SECOND,
            }
        )
    rng.shuffle(rows)
    return rows
