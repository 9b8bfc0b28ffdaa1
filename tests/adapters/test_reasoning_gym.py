"""reasoning-gym: its tasks as weir's prompts, scored by the task's own verifier."""

from __future__ import annotations

from pathlib import Path

import pytest

import weir
from weir.config import load_config
from weir.data.sample import Sample

rg = pytest.importorskip("reasoning_gym")

from weir.adapters import adapter_rows, adapter_sft_rows  # noqa: E402
from weir.adapters.reasoning_gym import near_miss, score  # noqa: E402
from weir.loop.components import reward_function  # noqa: E402

CONFIG = str(Path(__file__).parents[2] / "examples" / "reasoning_gym_quick.yaml")


def sample(text: str) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[2], response_text=text)


def test_rows_are_the_tasks_own_reproducible_and_held_out_questions_stay_out_of_training():
    cfg = load_config(CONFIG, ["data.train_size=300", "data.eval_size=20"])
    train, test = adapter_rows(cfg, "train"), adapter_rows(cfg, "test")
    assert len(test) == 20 and 0 < len(train) < 300  # held-out questions dropped from training
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    entry = rg.create_dataset("basic_arithmetic", seed=0, size=300, **cfg.reasoning_gym.options)[0]
    assert train[0]["prompt"] == entry["question"] or entry["question"] in {
        r["prompt"] for r in test
    }
    assert (
        adapter_rows(load_config(CONFIG, ["data.train_size=300", "data.eval_size=20"]), "train")
        == train
    )
    other = adapter_rows(load_config(CONFIG, ["data.train_size=300", "run.seed=1"]), "train")
    assert [r["prompt"] for r in other] != [r["prompt"] for r in train]
    r = test[0]
    a, b = (int(x) for x in r["prompt"].removeprefix("Calculate ").rstrip(".").split(" + "))
    assert r["answer"] == str(a + b)  # one-digit sums, as the options ask


def test_the_reward_is_the_tasks_verifier_with_an_optional_answer_tag():
    cfg = load_config(CONFIG, ["data.eval_size=3"])
    row = adapter_rows(cfg, "test")[0]
    reward = reward_function(cfg)
    assert reward(sample(row["answer"]), row)["reward"] == 1.0
    assert reward(sample(str(int(row["answer"]) + 1)), row)["reward"] < 1.0
    tagged = load_config(CONFIG, ["reasoning_gym.answer_tag=answer"])
    fn = reward_function(tagged)
    assert fn(sample(f"think... <answer>{row['answer']}</answer>"), row)["reward"] == 1.0
    assert fn(sample(row["answer"]), row) == {"reward": 0.0, "answer_found": 0.0}
    with pytest.raises(ValueError, match="rg_entry"):
        score(sample("1"), {"prompt": "x", "answer": "1"})


def test_any_task_name_and_its_options_pass_through_and_mistakes_get_one_line():
    for name in ("chain_sum", "letter_counting", "gcd"):
        cfg = load_config(CONFIG, [f"reasoning_gym.dataset={name}", "reasoning_gym.options={}"])
        (row,) = adapter_rows(cfg, "test")[:1]
        assert score(sample(row["answer"]), row)["reward"] == 1.0
    with pytest.raises(ValueError, match="its tasks are"):
        adapter_rows(load_config(CONFIG, ["reasoning_gym.dataset=no_such_task"]), "test")
    with pytest.raises(ValueError, match="unexpected keyword argument 'bogus'"):
        adapter_rows(load_config(CONFIG, ["reasoning_gym.options={bogus: 1}"]), "test")


def test_corrupted_sft_targets_are_near_misses_of_the_seeded_fraction():
    cfg = load_config(CONFIG, ["sft.rows=200", "data.eval_size=20"])
    rows = adapter_sft_rows(cfg)
    bad = [r for r in rows if r["corrupted"]]
    assert len(bad) == round(0.7 * len(rows))
    assert all(r["response"] == near_miss(r["answer"], [], None) != r["answer"] for r in bad)
    assert all(r["response"] == r["answer"] for r in rows if not r["corrupted"])
    assert near_miss("19", [], None) == "10" and near_miss("-4", [], None) == "-5"


@pytest.mark.slow
def test_grpo_raises_the_held_out_score_of_a_reasoning_gym_task(tmp_path):
    """The example as it is: SFT on 70%-corrupted answers, then 40 GRPO steps scored by the
    task's own verifier. Over seeds 0-4, and seed 0 on 2 threads (docs/ecosystem.md#reasoning-gym),
    the held-out score (20 questions never trained on, 16 samples each at temperature 1) rose by
    +0.21 to +0.32 and the sampled reward (last 5 steps against the first 5) by +0.14 to +0.23; the
    bounds are about half the smallest rise, as another CPU's rounding draws another trajectory."""
    sft = weir.sft(CONFIG, [f"run.dir={tmp_path / 'sft'}"])
    result = weir.run(CONFIG, [f"run.dir={tmp_path / 'rl'}", f"model.path={sft}"])
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 40 and all(h["rollout/failed"] == 0 for h in steps)
    rewards = [h["reward/mean"] for h in steps]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.07, rewards
    assert [e["step"] for e in result.evals] == [0, 20, 40]
    assert all(e["eval/prompts"] == 20 for e in result.evals)
    before, after = result.evals[0]["eval/accuracy"], result.evals[-1]["eval/accuracy"]
    assert after > before + 0.1, (before, after)
