"""The GUI demo learns: its SFT stage takes the tiny VLM from emitting no action to reaching most
held-out goals, and task-level RL on whole multi-turn episodes (the demo's settings) raises the
sampled success of the goals it trains on.

Success is the demo's measure: episodes sampled at the rollout temperature, the fraction that reach
their goal. Greedy success is not the measure: greedy episodes repeat a click that changed nothing
until the action budget runs out, a state RL's sampled episodes almost never reach, so RL cannot
correct it (docs/multimodal.md, "The GUI demo").

The SFT stage is the demo's: 1500 optimizer steps. The tiny VLM's clicks stay at chance for the
first few hundred (the loss plateaus near log 2 per coordinate digit) and then read the screen.
Where that happens depends on the CPU's rounding, so SFT lands anywhere from 47% to 75% (seeds and
CPUs measured in docs/multimodal.md).

Why the RL stage trains on 32 goals and is measured on them, not on held-out goals: the demo's 20
task-level steps raised held-out success on one CPU (+2.6 to +10.7 points over three seeds) and
lowered it on another (an AVX2 AMD EPYC: by 0.5 to 2.3 points from seed 1's 1500-step SFT model at
learning rates 2.5e-4 and 5e-4, by 8.2 points from a 750-step one), so a held-out rise is not a
claim this stage keeps on every machine. On a fixed set of goals it does (on the AVX2 EPYC, from
both SFT models and two goal sets): +12.9, +18.0 and +19.6 points in 20 steps (8 episodes a goal).
That is the claim a broken policy gradient would fail: a wrong sign, credit on the wrong turn,
log-probs of other tokens, or an update that does not reach the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weir.config import load_config
from weir.loop.sft import run_sft
from weir.loop.sync import run_sync
from weir.tasks import gui

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SEED = 1
GOALS = 32
RISE = 0.06
"""Well under the smallest rise measured: this test's own run on the AVX2 EPYC, 54.7% -> 65.4%
(+10.7 points; held-out after SFT 55.7%), and +12.9 to +19.6 above. Each evaluation plays every
goal 16 times (512 episodes; one evaluation's binomial standard error is at most 2.2 points, the
paired difference's about 3), so an RL stage that did nothing would pass about 1 time in 40."""


def test_sft_then_task_level_rl_raise_sampled_success(tmp_path):
    seed = f"run.seed={SEED}"

    def evaluate(model: str, name: str, *overrides: str) -> dict[str, float]:
        cfg = load_config(
            EXAMPLES / "gui.yaml",
            [seed, "run.steps=0", f"model.path={model}", f"run.dir={tmp_path / name}", *overrides],
        )
        return run_sync(cfg).evals[0]

    untrained = evaluate(
        "tiny-vlm:tiny", "untrained", "eval.temperature=0", "eval.n=1", "data.eval_size=48"
    )
    assert untrained["eval/accuracy"] == 0.0  # no action at all

    model = str(run_sft(load_config(EXAMPLES / "gui.yaml", [seed, f"run.dir={tmp_path / 'sft'}"])))
    held_out = evaluate(model, "held-out", "eval.n=2")
    assert held_out["eval/prompts"] == 192
    assert held_out["eval/accuracy"] >= 0.40  # 1500 SFT steps, seed 1: 56.4% and 61.9% (two CPUs)

    goals = tmp_path / "goals.jsonl"  # the RL stage's training goals: data.train_size rows
    goals.write_text("".join(json.dumps(r) + "\n" for r in gui.make_rows("train", GOALS, SEED)))
    rl = load_config(
        EXAMPLES / "gui.yaml",
        [
            seed,
            "run.eval_every=20",
            f"data.train_size={GOALS}",
            f"data.eval_source={goals}",
            f"data.eval_size={GOALS}",
            "eval.n=16",
            f"model.path={model}",
            f"run.dir={tmp_path / 'rl'}",
        ],
    )
    result = run_sync(rl)
    before, after = result.evals[0], result.evals[-1]
    assert before["eval/prompts"] == after["eval/prompts"] == GOALS
    assert rl.eval.temperature == rl.rollout.temperature == 1.0
    print(f"SFT held-out {held_out['eval/accuracy']:.3f}; RL's goals {before} -> {after}")
    # 20 task-level GRPO steps, 16 of the 32 goals x 8 episodes each
    assert after["eval/accuracy"] - before["eval/accuracy"] >= RISE

    diffs = [h["mismatch/abs_logp_diff"] for h in result.history if "mismatch/abs_logp_diff" in h]
    assert len(diffs) == 20 and max(diffs) < 1e-5  # engine = trainer log-probs, fp32
