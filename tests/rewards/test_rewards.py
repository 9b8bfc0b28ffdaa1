import asyncio
import functools
import math as pymath
import re
import threading
import time
from fractions import Fraction

import pytest

from weir.data.sample import Sample, Status
from weir.data.sources import read_jsonl
from weir.rollout import rewards as R
from weir.rollout.rewards import (
    REWARDS,
    exact_match,
    extract_number,
    get_reward,
    length_penalty,
    numeric,
    score,
    strip_eos,
)


def S(text: str, n_tokens: int = 0) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[5] * n_tokens, response_text=text)


@pytest.fixture(scope="module")
def gsm8k_test_rows():
    from weir.tasks.gsm8k import default_data_dir

    try:
        root = default_data_dir()
    except FileNotFoundError as e:
        pytest.skip(f"GSM8K data not available: {e}")
    return read_jsonl(root / "test.jsonl")


# ------------------------------------------------------------------------------ extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{42}", 42),
        ("A: 42", 42),
        ("The answer is 1,234.", 1234),
        ("#### 42", 42),
        ("so the total is $1,234,567", 1234567),
        ("x = -3", -3),
        ("The answer is -7.", -7),
        ("$-5", -5),
        ("-$5", -5),
        ("16 - 3 - 4 = 9", 9),  # binary minus is not a sign
        ("a price of 2.50 dollars", Fraction(5, 2)),
        ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
        ("\\boxed{1{,}000}", 1000),
        ("It took 3/4 of an hour", Fraction(3, 4)),
        ("first 5 then 7\n#### 12\n", 12),  # #### wins over the last number
        ("The answer is 8. Check: 2+6=8, and 100 more", 8),
        ("answer: 17 apples, 3 left", 17),
        ("The final answer is \\boxed{10} or 11", 10),
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_number(text, expected):
    assert extract_number(text) == (None if expected is None else Fraction(expected))


def test_strip_eos():
    assert strip_eos("  132<|end|> ") == "132"
    assert strip_eos("x</s><|end|>") == "x"
    assert strip_eos("x<|end|>", eos_texts=()) == "x<|end|>"


# ------------------------------------------------------------------------------- built-ins


def test_exact_match():
    assert exact_match(S("132"), {"answer": "132"}) == 1.0
    assert exact_match(S(" 132 <|end|>"), {"answer": " 132\n"}) == 1.0
    assert exact_match(S("133"), {"answer": "132"}) == 0.0
    assert exact_match(S("1320"), {"answer": 132}) == 0.0
    assert exact_match(S("Paris"), {"answer": "paris"}) == 0.0
    assert exact_match(S("Paris"), {"answer": "paris"}, case_sensitive=False) == 1.0
    assert exact_match(S("7"), {"gold": "7"}, answer_key="gold") == 1.0
    with pytest.raises(ValueError, match="'answer'"):
        exact_match(S("7"), {"gold": "7"})


@pytest.mark.parametrize("name", ["numeric", "math"])
@pytest.mark.parametrize(
    "response, gold, expected",
    [
        ("\\boxed{42}", "42", 1.0),
        ("A: 42", "42", 1.0),
        ("The answer is 1,234.", "1234", 1.0),
        ("The answer is 1,234.", "#### 1,234", 1.0),
        ("#### 42", "42", 1.0),
        ("#### 42", "She has 6*7=<<6*7=42>>42\n#### 42", 1.0),
        ("It costs $18.", "18", 1.0),
        ("#### 43", "42", 0.0),
        ("The answer is -3", "-3", 1.0),
        ("The answer is 3", "-3", 0.0),
        ("0.5", "0.5", 1.0),
        ("I don't know", "42", 0.0),
    ],
)
def test_numeric_and_math_by_hand(name, response, gold, expected):
    out = REWARDS[name](S(response), {"answer": gold})
    assert out["reward"] == expected, out


def test_math_symbolic_and_fallback():
    assert R.math(S("so it is $\\frac{1}{2}$"), {"answer": "0.5"})["reward"] == 1.0
    assert R.math(S("\\boxed{x^2+1}"), {"answer": "1+x^2"})["reward"] == 1.0
    out = R.math(S("nothing parseable"), {"answer": "42"})
    assert out["reward"] == 0.0


def test_math_in_worker_thread():
    """math-verify's signal timeouts must be off outside the main thread."""
    out = {}

    def run():
        out["r"] = R.math(S("\\boxed{42}"), {"answer": "42"})

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out["r"]["reward"] == 1.0


def test_numeric_tolerance():
    assert numeric(S("0.333333"), {"answer": "1/3"})["reward"] == 1.0
    assert numeric(S("1450001"), {"answer": "1,450,000"})["reward"] == 0.0  # integers exact


def test_numeric_gold_without_number_raises():
    with pytest.raises(ValueError, match="no number"):
        numeric(S("42"), {"answer": "forty-two"})


def test_format():
    assert R.format(S("work...\n#### 42<|end|>"), {}) == 1.0
    assert R.format(S("The answer is 5."), {}) == 1.0
    assert R.format(S("so \\boxed{5}"), {}) == 1.0
    assert R.format(S("A: 5"), {}) == 1.0
    assert R.format(S("#### 42\nand then more text"), {}) == 0.0
    assert R.format(S("I think it is 5"), {}) == 0.0
    assert R.format(S("<answer>3</answer>"), {}, pattern=r"<answer>.*</answer>\Z") == 1.0


def test_gsm8k_reference_solutions_score_one(gsm8k_test_rows):
    """Every reference solution is rewarded 1 by math and numeric; a changed final number 0."""
    assert len(gsm8k_test_rows) == 1319
    for r in gsm8k_test_rows:
        row = {"answer": r["answer"]}  # the full GSM8K solution as gold
        ref = S(r["answer"])
        gold = int(r["answer"].rsplit("####", 1)[1].replace(",", ""))
        wrong = S(r["answer"].rsplit("####", 1)[0] + f"#### {gold + 1}")
        for name in ("math", "numeric"):
            assert REWARDS[name](ref, row)["reward"] == 1.0, (name, r["answer"])
            assert REWARDS[name](wrong, row)["reward"] == 0.0, (name, r["answer"])
        # gold as the bare number, as weir.tasks.gsm8k stores it
        assert R.numeric(ref, {"answer": str(gold)})["reward"] == 1.0


# Endings a model writes after its answer line; each holds a number that is not the answer.
ENDINGS = [
    "\nNote: I assumed {k} items per box.",
    "\n\nHope this helps! Let me know if you have {k} more questions.",
    " dollars\nThat is the total after {k} weeks.",
    ".\n\nBest,\nTutor {k}",
    "\n(Checked twice, with {k} different methods.)",
]


def test_gsm8k_answer_line_is_read_not_a_later_note(gsm8k_test_rows):
    """A correct `#### N` line followed by a note, sign-off or unit that holds another number is
    rewarded 1 (math-verify alone reads the last number); a wrong answer line with the gold number in
    the note is rewarded 0. Regression for the `math` reward reading everything after `####`."""
    rows = gsm8k_test_rows[::25]
    for i, r in enumerate(rows):
        body, gold_text = r["answer"].rsplit("####", 1)
        gold = int(gold_text.replace(",", ""))
        ending = ENDINGS[i % len(ENDINGS)].format(k=gold + 7)
        right = S(f"{body}#### {gold}{ending}")
        wrong = S(f"{body}#### {gold + 1}\nNote: {gold} would be wrong.")
        for name in ("math", "numeric"):
            assert REWARDS[name](right, {"answer": r["answer"]})["reward"] == 1.0, (name, right)
            assert REWARDS[name](wrong, {"answer": r["answer"]})["reward"] == 0.0, (name, wrong)


# `#### N` followed on the same line by words that hold other numbers (model-written GSM8K endings)
SAME_LINE = [
    "#### {a} in total, from step {k}",
    "#### {a}.\nHope this helps, {k} steps",
    "#### ${c} dollars",
    "#### ${c} dollars, after {k} weeks",
    "#### {a} apples ({k} boxes of {k2})",
    "####{a} because {k} - {k2} = something",
    "#### {a}; checked with {k} methods.",
    "#### \\({a}\\) cookies for {k} kids",
]


def test_gsm8k_number_right_after_hashes_is_the_answer(gsm8k_test_rows):
    """GSM8K's and verl's convention: the number right after `####` is the answer, even when words
    holding other numbers follow on the same line; a wrong number there scores 0 even when the gold
    appears later on the line. Against both label formats: OpenAI's whole solution ("... #### 1,200")
    and the bare final number weir.tasks.gsm8k stores ("1200")."""
    from weir.tasks.gsm8k import final_answer

    rows = gsm8k_test_rows[::40]
    for i, r in enumerate(rows):
        body = r["answer"].rsplit("####", 1)[0]
        gold = int(final_answer(r["answer"]))
        k, k2 = gold + 3 + i % 5, 2 + i % 7
        for template in SAME_LINE:
            for answer, expected in ((gold, 1.0), (gold + 1, 0.0)):
                ending = template.format(a=answer, c=f"{answer:,}", k=k, k2=k2)
                if expected == 0.0:
                    ending += f" (not {gold})"
                response = S(body + ending)
                for label in (r["answer"], str(gold)):
                    got = R.math(response, {"answer": label})
                    assert got["reward"] == expected, (template, label, got)
                    assert numeric(response, {"answer": label})["reward"] == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("#### 18 in total, from step 1", 1.0),
        ("#### 18.\nHope this helps, 3 steps", 1.0),
        ("#### $1,200 dollars", 0.0),  # the gold is 18
        ("#### -18 degrees by 3 pm", 0.0),
        ("#### 3/4 of 24", 0.0),
        ("#### \\frac{36}{2} cups, from step 2", 1.0),
        ("#### 17 or maybe 18", 0.0),
        ("work: 18 \\boxed{18}", 1.0),  # no `####`: \boxed{} and plain answers still read
        ("The answer is 18. (Took 2 steps.)", 1.0),
    ],
)
def test_math_answer_after_hashes(response, expected):
    assert R.math(S(response), {"answer": "18"})["reward"] == expected
    assert R.math(S(response), {"answer": "She had 6 * 3 = <<6*3=18>>18\n#### 18"})["reward"] == (
        expected
    )


def test_answer_after_hashes_reads_the_leading_number():
    assert R.answer_after_hashes("x\n#### $1,200 dollars, from step 3") == "1200"
    assert R.answer_after_hashes("#### -5 degrees at 2 pm") == "-5"
    assert R.answer_after_hashes("#### 2.5 hours, 3 times") == "2.5"
    assert R.answer_after_hashes("#### \\frac{1}{2} cup, 3 times") == "1/2"
    assert R.answer_after_hashes("#### x^2 + 1") == " x^2 + 1"  # an expression: the whole line
    assert R.answer_after_hashes("#### 7\n#### 8 apples, 2 boxes") == "8"  # the last `####`


@pytest.mark.parametrize(
    "response",
    [
        "So the total is \\boxed{18}. (Checked with 2 methods.)",
        "\\boxed{18}\n\nBest regards, assistant 3",
        "The answer is 18.\n\nLet me know if you need help with 2 more problems.",
        "The final answer is $18$. Thanks for 1 great question!",
        "**Answer: 18**\n\nHope that helps, 1 step at a time!",
        "So she pays 18 dollars in total.\nAnswer: 18 dollars",
        "#### $18\nThat's the total for 4 weeks.",
    ],
)
def test_math_reads_realistic_endings(response):
    assert R.math(S(response), {"answer": "#### 18"})["reward"] == 1.0


def test_length_penalty():
    fn = length_penalty(exact_match, max_response_tokens=10, buffer_tokens=4)
    row = {"answer": "1"}
    assert fn(S("1", 6), row) == {"reward": 1.0, "base_reward": 1.0, "length_penalty": 0.0}
    assert fn(S("1", 8), row)["reward"] == pytest.approx(0.5)
    assert fn(S("1", 11), row)["reward"] == pytest.approx(0.0)
    with pytest.raises(ValueError):
        length_penalty(exact_match, max_response_tokens=4, buffer_tokens=4)

    async def afn(sample, row):
        return 1.0

    wrapped = length_penalty(afn, max_response_tokens=10, buffer_tokens=4)
    s = S("x", 9)
    asyncio.run(score(wrapped, s, row))
    assert s.reward == pytest.approx(0.25) and s.reward_info["length_penalty"] == pytest.approx(
        -0.75
    )


# ---------------------------------------------------------------------------------- score


def run(fn, sample=None, row=None, timeout_s=None):
    sample = sample or S("42")
    asyncio.run(score(fn, sample, row or {"answer": "42"}, timeout_s=timeout_s))
    return sample


def test_score_sync_float_and_dict():
    s = run(exact_match)
    assert s.reward == 1.0 and s.status is Status.COMPLETED and s.reward_info == {"reward": 1.0}
    s = run(numeric)
    assert s.reward == 1.0 and s.reward_info["pred"] == 42 and s.reward_info["gold"] == 42
    s = run(lambda sample, row: True)  # a bool counts as 1.0 / 0.0
    assert s.reward == 1.0 and s.status is Status.COMPLETED


def test_score_async_fn():
    async def afn(sample, row):
        await asyncio.sleep(0)
        return {"reward": 0.5, "parsed": "x"}

    s = run(afn)
    assert s.reward == 0.5 and s.reward_info == {"reward": 0.5, "parsed": "x"} and s.error is None


def test_score_contains_exceptions():
    def boom(sample, row):
        raise KeyError("missing")

    s = run(boom)
    assert s.status is Status.FAILED and s.reward is None
    assert s.error.startswith("RewardError: KeyError:") and "boom" in s.error

    async def aboom(sample, row):
        raise RuntimeError("async fail")

    s = run(aboom)
    assert s.status is Status.FAILED and s.error.startswith("RewardError: RuntimeError: async fail")


def test_score_timeout_sync_and_async():
    def slow(sample, row):
        time.sleep(0.5)
        return 1.0

    t0 = time.perf_counter()
    s = run(slow, timeout_s=0.05)
    assert time.perf_counter() - t0 < 0.45 or s.status is Status.FAILED
    assert s.status is Status.FAILED and s.reward is None
    assert s.error.startswith("RewardError: timeout") and "slow" in s.error

    async def aslow(sample, row):
        await asyncio.sleep(5)
        return 1.0

    t0 = time.perf_counter()
    s = run(aslow, timeout_s=0.05)
    assert time.perf_counter() - t0 < 1.0
    assert s.status is Status.FAILED and "timeout" in s.error


@pytest.mark.parametrize(
    "value, needle",
    [
        (float("nan"), "non-finite"),
        (float("inf"), "non-finite"),
        ("1.0", "returned str"),
        (None, "returned NoneType"),
        ({"score": 1.0}, "without 'reward'"),
        ({"reward": pymath.nan}, "non-finite"),
    ],
)
def test_score_bad_values_are_failures(value, needle):
    def weird(sample, row):
        return value

    s = run(weird)
    assert s.status is Status.FAILED and s.reward is None
    assert s.error.startswith("RewardError:") and needle in s.error and "weird" in s.error


def test_score_keeps_existing_reward_info_and_partial_name():
    s = S("42")
    s.reward_info["engine"] = "torch"
    asyncio.run(score(functools.partial(numeric, rel_tol=0.0), s, {"answer": "42"}))
    assert s.reward_info["engine"] == "torch" and s.reward == 1.0

    def boom(sample, row, *, k):
        raise ValueError("bad k")

    s = run(functools.partial(boom, k=1))
    assert "boom" in s.error


def test_score_many_concurrently():
    async def main():
        samples = [S(str(i)) for i in range(50)]
        await asyncio.gather(*(score(R.math, s, {"answer": "7"}) for s in samples))
        return samples

    samples = asyncio.run(main())
    assert [s.reward for s in samples] == [1.0 if i == 7 else 0.0 for i in range(50)]


# ------------------------------------------------------------------------------ get_reward


def test_get_reward():
    assert get_reward("math") is R.math
    fn = get_reward("exact_match", answer_key="gold")
    assert fn(S("7"), {"gold": "7"}) == 1.0
    fn = get_reward("weir.tasks.countdown:countdown_reward", format_score=0.2)
    assert fn(S("1+1"), {"numbers": [1, 2], "answer": "5"})["reward"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match=re.escape("did you mean 'numeric'")):
        get_reward("numerik")
    with pytest.raises(ValueError, match="no parameter"):
        get_reward("math", answer_kee="x")
