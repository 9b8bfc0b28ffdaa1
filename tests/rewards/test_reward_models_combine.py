"""reward.function: combine / reward.components: weighted sums with hand-computed totals, each
component in reward_info and in the step's metrics, failures failing or zeroing as configured."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.config import Config, load_config
from weir.data.sample import Group, Sample, Status
from weir.loop.components import reward_function
from weir.rollout.collect import summarize
from weir.rollout.combine import component_name
from weir.rollout.rewards import get_reward, score


def quarter(sample, row):
    return 0.25


def boom(sample, row):
    raise RuntimeError("component broke")


async def async_len(sample, row):
    await asyncio.sleep(0)
    return {"reward": float(len(sample.response_text)), "extra": "kept out"}


HERE = __name__


def S(text: str) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[5], response_text=text)


def run_score(fn, sample, row):
    asyncio.run(score(fn, sample, row, timeout_s=10))
    return sample


COMPONENTS = [
    {"function": "exact_match", "weight": 0.5},
    {"function": "format", "weight": 2.0, "name": "fmt"},
    {"function": f"{HERE}:quarter", "weight": -4.0},
    {"function": f"{HERE}:async_len", "weight": 0.1, "name": "length"},
]


def test_weighted_sum_hand_computed():
    fn = get_reward("combine", components=COMPONENTS)
    # "#### 7": exact_match vs "#### 7" = 1, format (ends with '#### <digit>') = 1, quarter = 0.25,
    # length = 6 characters
    s = run_score(fn, S("#### 7"), {"answer": "#### 7"})
    assert s.status == Status.COMPLETED
    assert s.reward == pytest.approx(0.5 * 1 + 2.0 * 1 + -4.0 * 0.25 + 0.1 * 6)  # 2.1
    assert s.reward_info["exact_match"] == 1.0
    assert s.reward_info["fmt"] == 1.0
    assert s.reward_info["quarter"] == 0.25
    assert s.reward_info["length"] == 6.0
    # the wrong answer without a final-answer line: only quarter and length remain
    s = run_score(fn, S("seven"), {"answer": "#### 7"})
    assert s.reward == pytest.approx(-1.0 + 0.5)


def test_each_component_is_a_step_metric():
    fn = get_reward("combine", components=COMPONENTS)
    samples = [run_score(fn, S(t), {"answer": "#### 7"}) for t in ("#### 7", "#### 8", "x")]
    metrics = summarize([Group(samples=samples)])
    assert metrics["reward/exact_match_mean"] == pytest.approx(1 / 3)
    assert metrics["reward/fmt_mean"] == pytest.approx(2 / 3)
    assert metrics["reward/length_mean"] == pytest.approx((6 + 6 + 1) / 3)
    assert metrics["reward/length"] == pytest.approx(13.0)  # the step's sum
    assert metrics["reward/mean"] == pytest.approx(
        (2.5 - 1 + 0.6 + (2.0 - 1 + 0.6) + (-1 + 0.1)) / 3
    )


def test_failing_component_fails_the_sample_by_default():
    fn = get_reward(
        "combine", components=[{"function": "exact_match"}, {"function": f"{HERE}:boom"}]
    )
    s = run_score(fn, S("7"), {"answer": "7"})
    assert s.status == Status.FAILED and s.reward is None
    assert "component broke" in s.error


def half_unless_x(sample, row):
    if "x" in sample.response_text:
        raise RuntimeError("component broke on x")
    return 0.5


def test_failing_component_scores_zero_when_configured_and_is_counted():
    fn = get_reward(
        "combine",
        components=[
            {"function": "exact_match", "weight": 3.0},
            {"function": f"{HERE}:half_unless_x", "weight": 5.0, "on_error": "zero", "name": "h"},
        ],
    )
    samples = [run_score(fn, S(t), {"answer": "7"}) for t in ("7", "x", "8")]
    assert [s.reward for s in samples] == [3.0 + 2.5, 0.0, 2.5]
    assert all(s.status == Status.COMPLETED for s in samples)
    assert "RuntimeError: component broke on x" in samples[1].reward_info["h_error"]
    metrics = summarize([Group(samples=samples)])
    assert metrics["reward/h_failed"] == 1.0
    assert metrics["reward/h_failed_mean"] == pytest.approx(1 / 3)
    assert metrics["reward/h_mean"] == pytest.approx((0.5 + 0 + 0.5) / 3)


def test_a_failed_sample_writes_no_component_metrics():
    fn = get_reward(
        "combine", components=[{"function": "exact_match"}, {"function": f"{HERE}:half_unless_x"}]
    )
    ok, bad = run_score(fn, S("7"), {"answer": "7"}), run_score(fn, S("x"), {"answer": "7"})
    assert bad.status == Status.FAILED and "metrics" not in bad.metadata
    metrics = summarize([Group(samples=[ok, bad])])
    assert metrics["reward/exact_match_mean"] == 1.0 and metrics["rollout/failed"] == 1.0


@pytest.mark.parametrize(
    "components, message",
    [
        ([], "non-empty list"),
        ([{"weight": 1.0}], "needs a 'function'"),
        ([{"function": "exact_match", "wieght": 1}], "unknown key"),
        ([{"function": "exact_match"}, {"function": "exact_match"}], "distinct 'name'"),
        ([{"function": "exact_match", "on_error": "ignore"}], "on_error"),
        ([{"function": "exact_match", "name": "mean"}], "reward/mean already means"),
        ([{"function": "no_such_reward"}], "no_such_reward"),
        ([{"function": "exact_match", "kwargs": {"bogus": 1}}], "bogus"),
    ],
)
def test_bad_components_are_refused_at_build(components, message):
    cfg = Config.model_validate(
        {"reward": {"function": "combine", "kwargs": {"components": components}}}
    )
    with pytest.raises(ValueError, match=message) as err:
        reward_function(cfg)
    assert "\n" not in str(err.value)


def test_reward_components_config_section():
    cfg = Config.model_validate(
        {
            "reward": {
                "components": [
                    {"function": "exact_match", "weight": 2.0},
                    {"function": "format", "weight": 0.5, "name": "fmt"},
                ]
            }
        }
    )
    fn = reward_function(cfg)
    s = run_score(fn, S("#### 7"), {"answer": "#### 7"})
    assert s.reward == pytest.approx(2.5)
    cfg = Config.model_validate(
        {"reward": {"function": "math", "components": [{"function": "exact_match"}]}}
    )
    with pytest.raises(ValueError, match="unset reward.function"):
        reward_function(cfg)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-10, 10), st.sampled_from(["7", "8"])), min_size=1, max_size=4))
def test_total_is_the_weighted_sum(parts):
    # each component is exact_match against "7" (always 1) or "8" (always 0) for the response "7"
    row = {"answer": "8", "a7": "7"}
    components = [
        {
            "function": "exact_match",
            "weight": w,
            "name": f"c{i}",
            "kwargs": {"answer_key": "a7" if gold == "7" else "answer"},
        }
        for i, (w, gold) in enumerate(parts)
    ]
    s = run_score(get_reward("combine", components=components), S("7"), row)
    assert s.reward == pytest.approx(sum(w for w, gold in parts if gold == "7"))
    assert [s.reward_info[f"c{i}"] for i in range(len(parts))] == [
        1.0 if gold == "7" else 0.0 for _, gold in parts
    ]


EXAMPLES = Path(__file__).parents[2] / "examples"


def test_the_examples_build():
    cfg = load_config(EXAMPLES / "reward_model_combined.yaml")
    fn = reward_function(cfg)  # the judge component is checked (template, pattern), not called
    assert fn.keywords["components"][2]["kwargs"]["model"] == "judge"
    assert [component_name(c) for c in fn.keywords["components"]] == ["correct", "format", "style"]
    cfg = load_config(EXAMPLES / "reward_model.yaml")
    with pytest.raises(ValueError, match="'/models/my-rm': cannot read its config"):
        reward_function(cfg)  # the placeholder RM path is refused before anything runs


def test_data_answer_key_retargets_the_components_that_read_the_ground_truth():
    cfg = Config.model_validate(
        {
            "data": {"answer_key": "solution"},
            "reward": {"components": [{"function": "exact_match"}, {"function": "format"}]},
        }
    )
    s = run_score(reward_function(cfg), S("#### 7"), {"solution": "#### 7"})
    assert s.status == Status.COMPLETED and s.reward == 2.0
