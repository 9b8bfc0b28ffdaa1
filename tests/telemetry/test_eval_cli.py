"""`weir eval` on a run's saved model reproduces the final evaluation the run logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import weir
from weir.cli.main import app
from weir.config import load_config
from weir.loop.components import task_rows
from weir.loop.evaluation import eval_config, is_run_dir

QUICK = str(Path(__file__).parents[2] / "examples" / "arithmetic_quick.yaml")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """SFT on correct answers (enough for some accuracy), then 3 GRPO steps; the model is saved."""
    root = tmp_path_factory.mktemp("eval_run")
    sft = weir.sft(
        QUICK,
        [
            f"run.dir={root / 'sft'}",
            "sft.rows=3000",
            "sft.epochs=4",
            "sft.task_options.corrupt=0.0",
            "telemetry.console=false",
        ],
    )
    return weir.run(
        QUICK,
        [
            f"run.dir={root / 'rl'}",
            f"model.path={sft}",
            "run.steps=3",
            "data.eval_size=60",
            "rollout.batch_prompts=8",
            "train.lr=1e-4",
            "telemetry.console=false",
        ],
    )


def logged_final_eval(run_dir: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "eval/accuracy" in r][-1]


@pytest.mark.slow
def test_eval_of_a_run_directory_reproduces_its_final_eval(trained_run, tmp_path):
    logged = logged_final_eval(trained_run.dir)
    assert 0 < logged["eval/accuracy"] < 1  # a non-trivial number to reproduce
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, ["eval", str(trained_run.dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    got = json.loads(out.read_text())
    for key in (
        "eval/accuracy",
        "eval/reward",
        "eval/pass@1",
        "eval/response_length",
        "eval/prompts",
    ):
        assert got[key] == pytest.approx(logged[key], abs=1e-9), key
    assert "eval/accuracy" in result.output and f"{logged['eval/accuracy']:.4f}" in result.output
    # the final checkpoint holds the same weights: evaluating it gives the same numbers
    ckpt = trained_run.dir / "checkpoints" / "step_00000003"
    result = CliRunner().invoke(app, ["eval", str(ckpt), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["eval/accuracy"] == pytest.approx(logged["eval/accuracy"])


@pytest.mark.slow
def test_eval_of_the_model_with_data_and_reward_flags(trained_run, tmp_path):
    """The same numbers from model/ with the run's held-out rows as --data and its reward."""
    logged = logged_final_eval(trained_run.dir)
    rows = task_rows(load_config(trained_run.dir / "config.yaml"), "test")
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval.json"
    args = ["eval", str(trained_run.dir / "model"), "--data", str(data), "--reward", "exact_match"]
    args += ["--max-new-tokens", "4", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    got = json.loads(out.read_text())
    for key in ("eval/accuracy", "eval/reward", "eval/response_length", "eval/prompts"):
        assert got[key] == pytest.approx(logged[key], abs=1e-9), key


def test_run_directory_settings_and_explicit_flags(tmp_path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "config.yaml").write_text(
        "data: {task: countdown, eval_size: 7}\neval: {n: 3, temperature: 0.5}\nrun: {seed: 4}\n"
    )
    assert is_run_dir(run) and not is_run_dir(run / "model")
    cfg = eval_config(str(run))
    assert cfg.model.path == str(run / "model")
    assert (cfg.data.task, cfg.data.eval_size, cfg.eval.n, cfg.eval.temperature, cfg.run.seed) == (
        "countdown",
        7,
        3,
        0.5,
        4,
    )
    cfg = eval_config(str(run), n=1, temperature=0.0)  # explicit flags win
    assert (cfg.eval.n, cfg.eval.temperature, cfg.data.eval_size) == (1, 0.0, 7)
    plain = eval_config("some/model", task="arithmetic")  # a bare model: the documented defaults
    assert (plain.eval.n, plain.eval.temperature, plain.data.eval_size) == (1, 0.0, 500)
    assert plain.eval.max_new_tokens == 64 and plain.model.path == "some/model"
