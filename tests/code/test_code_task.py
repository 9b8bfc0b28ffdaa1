"""The synthetic code task's data, and HumanEval: canonical solutions pass, broken ones fail."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from weir.data.sample import Sample
from weir.rollout.code_rewards import code_tests
from weir.sandbox import Limits, Sandbox
from weir.tasks import get_task
from weir.tasks.code import buggy_solution, make_rows, sft_rows, solution

SPEC = re.compile(r"^(add|sub|mul) (\d+) then (add|sub|mul) (\d+)$")


def _apply(spec: str, x: int) -> int:
    """The spec's value at x, computed from its words (independent of the task module)."""
    a, ka, b, kb = SPEC.match(spec).groups()
    step = {"add": lambda v, k: v + k, "sub": lambda v, k: v - k, "mul": lambda v, k: v * k}
    return step[b](step[a](x, int(ka)), int(kb))


def test_rows_reference_solutions_and_hidden_tests_agree_with_the_spec():
    rows = make_rows("train", 300, 0) + make_rows("test", 100, 0)
    for r in rows:
        ns: dict = {}
        exec(r["answer"], ns)
        assert all(ns["f"](x) == _apply(r["prompt"], x) for x in range(-5, 10)), r
        assert len(r["tests"]) == 4
        for t in r["tests"]:
            exec(t, ns)  # the reference passes every hidden test
    assert not {r["prompt"] for r in make_rows("train", 2000, 0)} & {
        r["prompt"] for r in make_rows("test", 300, 0)
    }
    assert make_rows("test", 50, 3) == make_rows("test", 50, 3)
    needs = [
        r for r in make_rows("train", 400, 0, parens_fraction=0.5) if "return (" in r["answer"]
    ]
    assert 150 < len(needs) < 250


def test_sft_corruption_is_the_precedence_bug_and_only_changes_problems_that_need_parentheses():
    rows = sft_rows(1000, 0, corrupt=0.8)
    assert sum(r["corrupted"] for r in rows) == 800
    for r in rows:
        if r["corrupted"]:
            body = r["answer"].split("return ")[1]
            assert (
                r["response"]
                == buggy_solution(r["prompt"])
                == "def f(x): return " + body.replace("(", "").replace(")", "")
            )
        else:
            assert r["response"] == solution(r["prompt"]) == r["answer"]
    with pytest.raises(ValueError, match="corrupt"):
        sft_rows(10, 0, corrupt=1.5)


def test_code_task_scores_reference_one_and_buggy_partial_in_the_sandbox():
    sb = Sandbox(Limits(wall_s=5, cpu_s=2))
    row = next(r for r in make_rows("test", 50, 0) if "return (" in r["answer"])
    good = code_tests(
        Sample(prompt_ids=[1], response_text=row["answer"] + "<|end|>"), row, sandbox=sb
    )
    bad = code_tests(
        Sample(prompt_ids=[1], response_text=buggy_solution(row["prompt"])), row, sandbox=sb
    )
    assert good["reward"] == 1.0
    expect = (
        sum(
            eval(
                buggy_solution(row["prompt"]).split("return ")[1],
                {"x": int(t.split("(")[1].split(")")[0])},
            )
            == int(t.split("== ")[1])
            for t in row["tests"]
        )
        / 4
    )
    assert bad["reward"] == pytest.approx(expect) and bad["reward"] < 1.0


def _humaneval_rows():
    try:
        return get_task("humaneval").make_rows("test")
    except FileNotFoundError as e:
        pytest.skip(f"HumanEval data not found: {e}")


def test_every_humaneval_canonical_solution_scores_1_and_a_broken_variant_0():
    rows = _humaneval_rows()
    assert len(rows) == 164
    sb = Sandbox(Limits(wall_s=15, cpu_s=10), max_parallel=4)

    def score(row, text):
        return code_tests(Sample(prompt_ids=[1], response_text=text), row, mode="all", sandbox=sb)

    with ThreadPoolExecutor(8) as pool:
        good = list(pool.map(lambda r: score(r, r["answer"]), rows))  # a completion of the prompt
        bad = list(pool.map(lambda r: score(r, "    return None\n"), rows))
    assert [r["task_id"] for r, g in zip(rows, good, strict=False) if g["reward"] != 1.0] == []
    assert [r["task_id"] for r, b in zip(rows, bad, strict=False) if b["reward"] != 0.0] == []
    # a chat-style answer restating the whole function in a fenced block scores the same
    row = rows[0]
    full = f"Here:\n```python\n{row['prefix']}{row['answer']}```\n"
    assert score(row, full)["reward"] == 1.0


def test_humaneval_is_eval_only_and_names_the_fix():
    get_task("humaneval")  # registered
    with pytest.raises(ValueError, match="only a 'test' split"):
        get_task("humaneval").make_rows("train", 10, 0)
    with pytest.raises(ValueError, match="evaluation set"):
        get_task("humaneval").sft_rows(10, 0)


@pytest.mark.slow
def test_weir_eval_humaneval_reports_pass_at_k_for_a_local_model(tmp_path):
    from weir.loop.evaluation import eval_config, run_eval
    from weir.tasks.tiny_model import build_tiny_model

    _humaneval_rows()
    model = build_tiny_model(tmp_path / "m", size="nano", max_position_embeddings=2600)
    cfg = eval_config(str(model), task="humaneval", size=3, n=2, temperature=1.0, max_new_tokens=4)
    assert cfg.data.max_prompt_tokens == 2048 and cfg.reward.function is None
    cfg.run.dir = str(tmp_path / "run")
    metrics = run_eval(cfg)
    # a random model writes no working code: every problem is scored, and none passes
    assert metrics["eval/prompts"] == 3 and metrics["eval/failed"] == 0
    assert metrics["eval/pass@1"] == 0.0 and metrics["eval/pass@2"] == 0.0
