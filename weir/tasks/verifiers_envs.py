"""Three `verifiers` environments built in code on weir's tasks, for the `verifiers` adapter's
example configs and CI (``verifiers.env: weir.tasks.verifiers_envs:<name>``; needs
``pip install 'weir[verifiers]'``):

- `arithmetic`: a ``SingleTurnEnv`` over the arithmetic task's sums (prompt ``"3+4"``), its
  rubric 1.0 when the answer is exactly the sum.
- `calculator`: a ``ToolEnv`` over multiplications with a python tool, ``multiply(a, b)``; its
  rubric scores the final answer (and counts the tool calls, verifiers' own metric).
- `higher_lower`: a ``MultiTurnEnv`` game: the model guesses a hidden digit, ``env_response``
  answers ``higher`` / ``lower`` (a python function of the guess, `hint`) until it is found
  (``final_env_response``) or the turns run out; its rubric gives 1 / (guesses) for a found digit.

Each takes `train_size`, `eval_size` and `seed`; train and held-out rows never share a problem
(the arithmetic task's split by hash) except in `higher_lower`, whose rows are just the hidden
digits.
"""

from __future__ import annotations

import random
import re
from typing import Any

from weir.tasks.arithmetic import make_rows

__all__ = ["arithmetic", "calculator", "higher_lower", "multiply", "hint"]


def _vf() -> Any:
    import verifiers as vf

    return vf


def _dataset(rows: list[dict[str, Any]]) -> Any:
    from datasets import Dataset

    return Dataset.from_list([{"question": r["prompt"], "answer": r["answer"]} for r in rows])


def _last_answer(parser: Any, completion: Any) -> str:
    return (parser.parse_answer(completion) or "").strip()


def exact_answer(parser: Any, completion: Any, answer: str) -> float:
    """1.0 when the last assistant message is exactly the answer."""
    return float(_last_answer(parser, completion) == str(answer))


def arithmetic(
    train_size: int = 2000,
    eval_size: int = 100,
    digits: int = 1,
    seed: int = 0,
    system_prompt: str | None = None,
) -> Any:
    """A SingleTurnEnv over `digits`-digit sums, exact-match rubric."""
    vf = _vf()
    parser = vf.Parser()
    return vf.SingleTurnEnv(
        dataset=_dataset(make_rows("train", train_size, seed, digits=digits)),
        eval_dataset=_dataset(make_rows("test", eval_size, seed + 10_000, digits=digits)),
        system_prompt=system_prompt,
        parser=parser,
        rubric=vf.Rubric(funcs=[exact_answer], parser=parser),
    )


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return int(a) * int(b)


def calculator(
    train_size: int = 2000, eval_size: int = 64, seed: int = 0, max_turns: int = 3
) -> Any:
    """A ToolEnv over 2-digit x 1-digit multiplications with the `multiply` tool."""
    vf = _vf()
    parser = vf.Parser()
    kw = {"digits": 2, "min_digits": 1, "ops": "*"}
    return vf.ToolEnv(
        dataset=_dataset(make_rows("train", train_size, seed, **kw)),
        eval_dataset=_dataset(make_rows("test", eval_size, seed + 10_000, **kw)),
        tools=[multiply],
        max_turns=max_turns,
        parser=parser,
        rubric=vf.Rubric(funcs=[exact_answer], parser=parser),
    )


def hint(guess: str, target: int) -> str:
    """The game's answer to a guess: ``correct``, ``higher``, ``lower``, or a reminder of the
    rules when the guess holds no digit."""
    found = re.search(r"\d", guess)
    if found is None:
        return "say one digit, 0-9"
    value = int(found.group())
    return "correct" if value == target else ("higher" if value < target else "lower")


def guessed(parser: Any, completion: Any, answer: str) -> float:
    """1 / (guesses so far) at the first right guess, 0 when none is right."""
    turns = [m for m in completion if parser._message_field(m, "role") == "assistant"]
    for i, m in enumerate(turns):
        text = parser.parse_answer([m]) or ""
        if hint(text, int(answer)) == "correct":
            return 1.0 / (i + 1)
    return 0.0


def _higher_lower_cls() -> type:
    vf = _vf()

    class HigherLower(vf.MultiTurnEnv):
        """Guess the hidden digit; the environment answers higher / lower, and a right guess
        ends the game (``final_env_response``)."""

        async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
            reply = [
                vf.UserMessage(
                    content=hint(_last_answer(self.parser, messages), int(state["answer"]))
                )
            ]
            if reply[0].content == "correct":
                state["final_env_response"] = reply
            return reply

    return HigherLower


def higher_lower(
    train_size: int = 2000, eval_size: int = 20, seed: int = 0, max_turns: int = 3
) -> Any:
    """The higher/lower game, hidden digits drawn with `seed` (held out: `seed` + 10000)."""
    vf = _vf()
    parser = vf.Parser()

    def digits(n: int, s: int) -> Any:
        rng = random.Random(s)
        rows = [
            {"prompt": "Guess my digit (0-9).", "answer": str(rng.randrange(10))} for _ in range(n)
        ]
        return _dataset(rows)

    return _higher_lower_cls()(
        dataset=digits(train_size, seed),
        eval_dataset=digits(eval_size, seed + 10_000),
        max_turns=max_turns,
        parser=parser,
        rubric=vf.Rubric(funcs=[guessed], parser=parser),
    )
