"""Proposer and checker: a two-role arithmetic task for multi-agent episodes (one shared policy).

The proposer sees ``47+85`` under its role prompt and proposes a sum; the checker sees the problem
and ``proposer: 133`` under its own role prompt and answers ``yes`` or ``no``. The scorer rewards
the team (the checker accepts a correct sum) and each role (the proposer: its sum is right; the
checker: its verdict is right). Config: examples/proposer_checker.yaml; docs/multi-agent.md shows
why this pair does not cooperate (the checker learns the base rate, not to verify) and the relay
task (weir/tasks/relay.py) that does.

SFT data makes both roles weak in a way RL can fix: the proposer's targets are systematically
wrong (`corrupt`, as in the arithmetic demo) and the checker, shown correct and systematically
wrong proposals half and half, accepts a wrong one with probability `lenient`.
"""

from __future__ import annotations

import random
from typing import Any

from weir.rollout.multi_agent import opening_messages, turn_line
from weir.rollout.roles import Episode
from weir.tasks import arithmetic

__all__ = ["make_rows", "sft_rows", "score", "verdict", "PROPOSER", "CHECKER", "REWARD"]

REWARD = "exact_match"  # unused when multi_agent.scorer is this module's `score`
DESCRIPTION = "a proposer proposes a sum, a checker accepts or rejects it (two roles, one policy)"
PROPOSER, CHECKER = "proposer", "checker"
PROMPTS = {PROPOSER: "propose the result", CHECKER: "check the result: yes or no"}


def make_rows(split: str, n: int, seed: int, **difficulty: Any) -> list[dict[str, Any]]:
    """Arithmetic problems (`weir.tasks.arithmetic.make_rows`), tagged with this task."""
    return [
        {**r, "task": "proposer_checker"}
        for r in arithmetic.make_rows(split, n, seed, **difficulty)
    ]


def verdict(text: str | None) -> bool | None:
    """The checker's verdict: True for ``yes``, False for ``no``, None for anything else."""
    word = (text or "").strip().lower()
    return {"yes": True, "no": False}.get(word)


def score(episode: Episode, row: dict) -> dict[str, float]:
    """team = 1 when the checker accepts a correct sum; proposer = 1 when its sum is correct;
    checker = 1 when its verdict is right (yes to a correct sum, no to a wrong one)."""
    proposal = episode.last(PROPOSER)
    correct = proposal is not None and proposal.strip() == str(row["answer"])
    said = verdict(episode.last(CHECKER))
    return {
        "team": float(correct and said is True),
        PROPOSER: float(correct),
        CHECKER: float(said is not None and said == correct),
    }


def sft_rows(
    n: int, seed: int, *, corrupt: float = 0.7, lenient: float = 0.7, **difficulty: Any
) -> list[dict[str, Any]]:
    """`2n` SFT rows: `n` proposer turns (a `corrupt` fraction with the sum's last digit off by
    one) and `n` checker turns (half the proposals correct, answered ``yes``; half off by one,
    answered ``yes`` with probability `lenient`, else ``no``). Each row's ``messages`` is the chat
    the role sees in an episode (`opening_messages`), so SFT and RL prompts are the same tokens."""
    for name, v in (("corrupt", corrupt), ("lenient", lenient)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"proposer_checker: {name} must be in [0, 1], got {v}")
    rng = random.Random(f"proposer-checker-sft:{seed}")
    rows: list[dict[str, Any]] = []
    for p in arithmetic.sft_rows(n, seed, corrupt=corrupt, **difficulty):
        problem = {"prompt": p["prompt"]}
        rows.append(
            {
                "messages": opening_messages(problem, PROMPTS[PROPOSER], []),
                "response": p["response"],
                "answer": p["answer"],
                "role": PROPOSER,
            }
        )
    for p in arithmetic.make_rows("train", n, seed + 1, **difficulty):
        wrong = rng.random() < 0.5
        proposal = arithmetic.corrupt_answer(p["answer"]) if wrong else p["answer"]
        accepts = (not wrong) or rng.random() < lenient
        earlier = [turn_line(PROPOSER, proposal)]
        rows.append(
            {
                "messages": opening_messages({"prompt": p["prompt"]}, PROMPTS[CHECKER], earlier),
                "response": "yes" if accepts else "no",
                "answer": p["answer"],
                "role": CHECKER,
            }
        )
    rng.shuffle(rows)
    return rows
