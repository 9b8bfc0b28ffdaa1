import os
from fractions import Fraction

import pytest

from tests.fresh_python import printed_words
from weir.data.sample import Sample
from weir.rollout.rewards import get_reward
from weir.tasks import TASKS, TaskSpec, arithmetic, countdown, get_task, gsm8k


def S(text: str) -> Sample:
    return Sample(prompt_ids=[1], response_text=text)


# ------------------------------------------------------------------------------------ registry


def test_a_tasks_reward_loads_neither_the_other_tasks_nor_the_engine():
    """A Ray reward worker unpickling a task's reward and text samples imports that task's module
    and the rewards module, not every task (the GUI renderer, the calculator's rollout) nor weir's
    engine, transformers or torch: on a 2-core machine that import took 14 s, and each worker of
    each run paid it."""
    program = (
        "import sys, pickle, weir.tasks.gsm8k, weir.rollout.rewards, weir.tasks as t; "
        "from weir.data.sample import Sample; "
        "t.get_task('arithmetic'); get = weir.rollout.rewards.get_reward('exact_match'); "
        "pickle.loads(pickle.dumps(Sample(prompt_ids=[1], response_ids=[2], response_text='4'))); "
        "print(sorted(m for m in sys.modules if m.startswith(('weir.engine', 'weir.tasks.', "
        "'transformers', 'weir.rollout.collect', 'torch'))))"
    )
    assert printed_words(program) == [
        "['weir.tasks.arithmetic',",
        "'weir.tasks.gsm8k',",
        "'weir.tasks.shared_data']",
    ]


def test_registry():
    assert set(TASKS) == {
        "arithmetic",
        "calculator",
        "code",
        "countdown",
        "gsm8k",
        "gui",
        "humaneval",
        "shapes",
        "proposer_checker",
        "relay",
    }
    for name, spec in TASKS.items():
        assert isinstance(spec, TaskSpec) and spec.name == name and spec.description
        assert callable(get_reward(spec.reward))  # every default reward resolves
    assert get_task("arithmetic").reward == "exact_match"
    with pytest.raises(ValueError) as e:
        get_task("arithmetc")
    valid = (
        "['arithmetic', 'calculator', 'code', 'countdown', 'gsm8k', 'gui', 'humaneval', "
        "'proposer_checker', 'relay', 'shapes']"
    )
    assert valid in str(e.value) and "did you mean" in str(e.value)


# ---------------------------------------------------------------------------------- arithmetic


def test_arithmetic_answers_by_hand():
    assert arithmetic._row(47, "+", 85) == {
        "prompt": "47+85",
        "answer": "132",
        "task": "arithmetic",
    }
    assert arithmetic._row(12, "*", 34)["answer"] == "408"
    assert arithmetic._row(3, "-", 9)["answer"] == "-6"
    for row in arithmetic.make_rows("train", 300, 0, ops="+-*", digits=3, min_digits=1):
        op = next(c for c in "+-*" if c in row["prompt"][1:])
        x, y = row["prompt"].split(op, 1)
        expected = {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
        assert row["answer"] == str(expected)
        assert 1 <= len(x) <= 3 and 1 <= len(y) <= 3


def test_arithmetic_digits_ops_and_determinism():
    rows = arithmetic.make_rows("train", 200, 1)
    assert rows == arithmetic.make_rows("train", 200, 1)
    assert rows != arithmetic.make_rows("train", 200, 2)
    assert all(len(r["prompt"]) == 5 and r["prompt"][2] == "+" for r in rows)
    assert len({r["prompt"] for r in rows}) == 200  # distinct while the space lasts
    mixed = arithmetic.make_rows("train", 400, 0, ops="+*")
    ops = {("*" if "*" in r["prompt"] else "+") for r in mixed}
    assert ops == {"+", "*"}
    big = arithmetic.make_rows("test", 50, 0, digits=5)
    assert all(len(r["prompt"]) == 11 for r in big)
    with pytest.raises(ValueError, match="ops"):
        arithmetic.make_rows("train", 1, 0, ops="/")
    with pytest.raises(ValueError, match="split"):
        arithmetic.make_rows("val", 1, 0)


@pytest.mark.parametrize("opts", [{}, {"digits": 1}, {"digits": 3, "ops": "+*"}, {"digits": 6}])
def test_arithmetic_no_train_test_overlap(opts):
    train = {r["prompt"] for r in arithmetic.make_rows("train", 3000, 0, **opts)}
    test = {r["prompt"] for r in arithmetic.make_rows("test", 500, 0, **opts)}
    test_other_seed = {r["prompt"] for r in arithmetic.make_rows("test", 500, 10_000, **opts)}
    assert not train & test and not train & test_other_seed
    assert all(arithmetic.split_of(p) == "test" for p in test)


def test_arithmetic_in_words_keeps_the_problems_and_their_split():
    words = "What is {a} {op} {b}? Reply with only the final number."
    bare = arithmetic.make_rows("test", 100, 3)
    worded = arithmetic.make_rows("test", 100, 3, template=words)
    assert [r["answer"] for r in worded] == [r["answer"] for r in bare]
    first = bare[0]["prompt"]
    assert (
        worded[0]["prompt"]
        == f"What is {first[:2]} + {first[3:]}? Reply with only the final number."
    )
    with pytest.raises(ValueError, match=r"only \{a\}, \{op\} and \{b\}"):
        arithmetic.make_rows("test", 1, 0, template="What is {x}?")


def test_arithmetic_small_space_repeats_within_split():
    rows = arithmetic.make_rows("train", 500, 0, digits=1)  # ~90 train problems of 100
    assert len(rows) == 500 and len({r["prompt"] for r in rows}) < 100


def test_arithmetic_sft_corruption():
    n = 1000
    rows = arithmetic.sft_rows(n, 0, corrupt=0.3)
    bad = [r for r in rows if r["corrupted"]]
    assert len(bad) == 300  # exactly round(f * n)
    for r in rows:
        assert r["answer"] == str(eval(r["prompt"]))  # noqa: S307 (trusted, generated here)
        if r["corrupted"]:
            # systematic: always the last digit + 1 (mod 10)
            assert r["response"] == r["answer"][:-1] + str((int(r["answer"][-1]) + 1) % 10)
            assert r["response"] != r["answer"]
        else:
            assert r["response"] == r["answer"]
    # chosen by a seeded RNG, not by content: same problems, other seed -> other rows corrupted
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in arithmetic.sft_rows(n, 0)]
    assert rows == arithmetic.sft_rows(n, 0, corrupt=0.3)
    assert not any(r["corrupted"] for r in arithmetic.sft_rows(n, 0))
    assert all(r["corrupted"] for r in arithmetic.sft_rows(50, 0, corrupt=1.0))
    assert arithmetic.corrupt_answer("139") == "130"
    # the target is exactly what exact_match rewards
    good = next(r for r in rows if not r["corrupted"])
    assert get_reward("exact_match")(S(good["response"] + "<|end|>"), good) == 1.0
    wrong = next(r for r in rows if r["corrupted"])
    assert get_reward("exact_match")(S(wrong["response"]), wrong) == 0.0


# ----------------------------------------------------------------------------------- countdown


def test_countdown_rows_are_reachable():
    rows = countdown.make_rows("train", 150, 0)
    assert rows == countdown.make_rows("train", 150, 0)
    for r in rows:
        assert 3 <= len(r["numbers"]) <= 4 and all(1 <= x <= 99 for x in r["numbers"])
        assert 1 <= r["target"] <= 100 and r["answer"] == str(r["target"])
        assert r["prompt"] == f"Using {' '.join(map(str, r['numbers']))} make {r['target']}"
        value, used = countdown.safe_eval(r["solution"])
        assert value == r["target"]
        assert not (set(used) - set(r["numbers"]))
        assert countdown.countdown_reward(S(r["solution"]), r)["reward"] == 1.0
    sft = countdown.sft_rows(20, 0)
    assert all(countdown.safe_eval(r["response"])[0] == r["target"] for r in sft)


def test_countdown_no_train_test_overlap():
    key = lambda r: (tuple(sorted(r["numbers"])), r["target"])  # noqa: E731
    train = {key(r) for r in countdown.make_rows("train", 600, 0)}
    test = {key(r) for r in countdown.make_rows("test", 100, 0)}
    assert not train & test


def test_countdown_solver():
    sol = countdown.solve([3, 7, 25], 46)
    assert sol is not None and countdown.safe_eval(sol)[0] == 46
    assert countdown.solve([1, 2], 100) is None
    sol = countdown.solve([4, 6, 8], 3)  # needs division
    assert sol is not None and countdown.safe_eval(sol)[0] == 3


def test_safe_eval():
    assert countdown.safe_eval("25+3*7") == (Fraction(46), [25, 3, 7])
    assert countdown.safe_eval("(8-2)/4") == (Fraction(3, 2), [8, 2, 4])
    for bad in [
        "__import__('os').system('echo hi')",
        "x+1",
        "abs(3)",
        "3**2",
        "-3+5",
        "2.5*2",
        "'a'*3",
        "(1).real",
        "[1, 2]",
        "1 if 1 else 2",
        "3 7",
        "1/0",
        "(" * 300 + "1" + ")" * 300,
    ]:
        with pytest.raises(ValueError):
            countdown.safe_eval(bad)


@pytest.mark.parametrize(
    "response, reward",
    [
        ("25+3*7", 1.0),
        ("3*7+25<|end|>", 1.0),
        ("(25 + 7*3) = 46", 1.0),
        ("I think\n<answer>25+3*7</answer>", 1.0),
        ("25+3*7+0", 0.1),  # a number that was not given
        ("25+25-7+3", 0.1),  # 25 used twice
        ("25+3", 0.1),  # well formed, wrong value
        ("25/(7-7)", 0.1),  # well formed, 7 twice and division by zero
        ("__import__('os')", 0.0),
        ("twenty five", 0.0),
        ("", 0.0),
    ],
)
def test_countdown_reward(response, reward):
    row = {"numbers": [3, 7, 25], "answer": "46", "prompt": "Using 3 7 25 make 46"}
    assert countdown.countdown_reward(S(response), row)["reward"] == pytest.approx(reward)


def test_countdown_reward_numbers_from_prompt_and_format_score():
    row = {"prompt": "Using 3 7 25 make 46", "answer": "46"}
    assert countdown.countdown_reward(S("25+3*7"), row)["reward"] == 1.0
    assert countdown.countdown_reward(S("25+3"), row, format_score=0.0)["reward"] == 0.0


# --------------------------------------------------------------------------------------- gsm8k


@pytest.fixture(scope="module")
def gsm8k_dir():
    try:
        return gsm8k.default_data_dir()
    except FileNotFoundError as e:
        pytest.skip(f"GSM8K data not available: {e}")


def test_gsm8k_rows(gsm8k_dir):
    with open(gsm8k_dir / "test.jsonl", encoding="utf-8") as f:
        n_lines = sum(1 for line in f if line.strip())
    rows = gsm8k.make_rows("test")
    assert len(rows) == n_lines == 1319
    first = rows[0]
    assert first["answer"] == "18" and first["solution"].endswith("#### 18")
    assert first["prompt"].startswith("Janet") and first["prompt"].endswith(
        gsm8k.DEFAULT_INSTRUCTION
    )
    assert all("," not in r["answer"] for r in rows)
    bare = gsm8k.make_rows("test", instruction=None)
    assert [r["prompt"] for r in bare] == [r["question"] for r in rows]
    sub = gsm8k.make_rows("test", 10, 3)
    assert len(sub) == 10 and sub == gsm8k.make_rows("test", 10, 3)
    # the math reward (the task default) scores the stored answer
    reward = get_reward(get_task("gsm8k").reward)
    assert all(reward(S(r["solution"]), r)["reward"] == 1.0 for r in rows[:50])


def test_gsm8k_sft_rows(gsm8k_dir):
    rows = gsm8k.sft_rows(20, 0)
    assert len(rows) == 20
    for r in rows:
        assert "<<" not in r["response"] and r["response"].rstrip().endswith(
            f"#### {r['solution'].rsplit('####', 1)[1].strip()}"
        )


def test_gsm8k_data_dir_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("WEIR_GSM8K_DIR", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="WEIR_GSM8K_DIR"):
        gsm8k.make_rows("test")
    monkeypatch.setenv("WEIR_GSM8K_DIR", str(tmp_path))
    (tmp_path / "test.jsonl").write_text('{"question": "1+1?", "answer": "2\\n#### 2"}\n')
    assert gsm8k.make_rows("test") == [
        {
            "prompt": "1+1?\n" + gsm8k.DEFAULT_INSTRUCTION,
            "answer": "2",
            "solution": "2\n#### 2",
            "question": "1+1?",
            "task": "gsm8k",
        }
    ]
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        gsm8k.make_rows("train")
    monkeypatch.delenv("WEIR_GSM8K_DIR")
    monkeypatch.setattr(gsm8k, "_candidates", lambda: [tmp_path / "nowhere"])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        gsm8k.default_data_dir()
    assert os.environ.get("WEIR_GSM8K_DIR") is None
