from __future__ import annotations

import math

import pytest

from weir.config import build_config
from weir.data.sample import Status
from weir.engine.base import Completion, SamplingParams
from weir.loop.run import RunError
from weir.loop.sync import check_failures
from weir.rollout.collect import collect_groups
from weir.rollout.evaluate import evaluate, pass_at_k
from weir.rollout.filters import nonzero_std
from weir.rollout.single_turn import RolloutContext, rollout
from weir.tasks.tiny_model import build_tokenizer


class ScriptedEngine:
    """Answers each prompt with the given texts (cycled), log-prob -0.5 per token, version 3."""

    def __init__(self, tokenizer, answers: list[str]) -> None:
        self.tok, self.answers, self.version = tokenizer, answers, 3

    async def generate(self, prompt_ids, params: SamplingParams) -> list[Completion]:
        out = []
        for i in range(params.n):
            ids = self.tok(self.answers[i % len(self.answers)], add_special_tokens=False)[
                "input_ids"
            ] + [self.tok.eos_token_id]
            out.append(
                Completion(
                    token_ids=ids,
                    logprobs=[-0.5] * len(ids),
                    versions=[3] * len(ids),
                    finish_reason="stop",
                )
            )
        return out


def _ctx(answers, reward, n=4):
    tok = build_tokenizer()
    return RolloutContext(
        engine=ScriptedEngine(tok, answers),
        tokenizer=tok,
        sampling=SamplingParams(n=n),
        reward_fn=reward,
        encode=lambda row: tok(row["prompt"], add_special_tokens=False)["input_ids"],
    )


def exact(sample, row):
    return float(sample.response_text.strip() == row["answer"])


ROWS = [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2", "answer": "4"}]


def test_groups_carry_tokens_logprobs_versions_and_rewards():
    groups, metrics = collect_groups(_ctx(["2", "3"], exact), ROWS, rollout)
    assert [g.group_id for g in groups] == [0, 1]
    s = groups[0].samples[0]
    assert (
        s.response_text == "2"
        and s.reward == 1.0
        and s.versions == [3, 3]
        and s.rollout_logprobs == [-0.5, -0.5]
    )
    assert [x.reward for x in groups[0].samples] == [1.0, 0.0, 1.0, 0.0]
    assert metrics["reward/mean"] == pytest.approx(0.25)  # group 0: 2 of 4 right, group 1: none
    assert metrics["response/length_mean"] == 2.0 and metrics["rollout/failed"] == 0


def test_a_raising_reward_fails_the_sample_not_the_step():
    def flaky(sample, row):
        if row["prompt"] == "2+2":
            raise KeyError("boom")
        return 1.0

    groups, metrics = collect_groups(_ctx(["2"], flaky), ROWS, rollout)
    failed = [s for s in groups[1].samples]
    assert all(s.status == Status.FAILED and "boom" in s.error for s in failed)
    assert metrics["rollout/failed"] == 4 and metrics["rollout/failed_frac"] == 0.5
    with pytest.raises(RunError, match="boom"):
        check_failures(build_config({}, ["rollout.max_failed_fraction=0.4"]), groups, metrics)
    check_failures(build_config({}, ["rollout.max_failed_fraction=0.5"]), groups, metrics)


def test_a_raising_rollout_function_fails_its_group():
    async def broken(ctx, row):
        raise RuntimeError("env down")

    groups, metrics = collect_groups(_ctx(["2"], exact), ROWS, broken)
    assert len(groups) == 2 and metrics["rollout/failed"] == 2
    assert "env down" in groups[0].samples[0].error


def test_filter_drops_zero_variance_groups_and_counts_them():
    groups, metrics = collect_groups(_ctx(["2", "3"], exact), ROWS, rollout, keep=nonzero_std)
    assert [g.row["prompt"] for g in groups] == ["1+1"]
    assert metrics["rollout/filtered_groups"] == 1


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5


def test_evaluate_reports_accuracy_and_pass_at_k():
    metrics, _ = evaluate(_ctx(["2", "3", "3", "3"], exact), ROWS, rollout)
    assert metrics["eval/accuracy"] == pytest.approx(1 / 8)
    assert metrics["eval/pass@1"] == pytest.approx(0.125)
    assert metrics["eval/pass@4"] == pytest.approx(0.5)


def test_evaluate_breaks_accuracy_down_by_a_row_field():
    rows = [
        {"prompt": "1+1", "answer": "2", "kind": "add"},
        {"prompt": "3-1", "answer": "2", "kind": "sub"},
        {"prompt": "2+2", "answer": "4", "kind": "add"},
        {"prompt": "no kind", "answer": "3"},
    ]
    # every prompt gets "2", "3", "3", "3": one of 4 right where the answer is 2, three where it is 3
    metrics, _ = evaluate(_ctx(["2", "3", "3", "3"], exact), rows, rollout, breakdown="kind")
    assert metrics["eval/kind/add/accuracy"] == pytest.approx((1 + 0) / 8)
    assert metrics["eval/kind/sub/accuracy"] == pytest.approx(1 / 4)
    assert metrics["eval/accuracy"] == pytest.approx((1 + 1 + 0 + 3) / 16)
    assert not any(
        k.startswith("eval/kind/") for k in evaluate(_ctx(["2"], exact), rows, rollout)[0]
    )
