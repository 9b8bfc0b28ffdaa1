from __future__ import annotations

import yaml
from typer.testing import CliRunner

from weir.cli.main import app

runner = CliRunner()


def test_print_config_applies_overrides():
    res = runner.invoke(
        app,
        ["train", "examples/arithmetic.yaml", "rollout.n=3", "algo.kl.coef=0.01", "--print-config"],
    )
    assert res.exit_code == 0, res.output
    cfg = yaml.safe_load(res.output)
    assert cfg["rollout"]["n"] == 3 and cfg["algo"]["kl"]["coef"] == 0.01


def test_config_error_exits_2_with_the_key():
    res = runner.invoke(
        app, ["train", "examples/arithmetic.yaml", "rollout.nn=3", "--print-config"]
    )
    assert res.exit_code == 2
    assert "rollout.nn" in res.output and "rollout.n" in res.output


def test_every_command_has_help():
    for cmd in ("train", "sft", "eval", "demo", "config-docs"):
        res = runner.invoke(app, [cmd, "--help"])
        assert res.exit_code == 0 and "Usage" in res.output


def _commands(group, path=()):
    """(argv prefix, click command) of every command under `group`, sub-groups included."""
    import click

    for name, cmd in group.commands.items():
        yield [*path, name], cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))


def test_help_prints_every_bracketed_text_the_source_has():
    """rich reads `[word]` as a style tag and drops it ("Defaults in  apply ..."): every `[...]` in
    a command's or an option's help must reach `--help` as written, on every command."""
    import re

    import typer

    root = typer.main.get_command(app)
    checked = 0
    for argv, cmd in _commands(root):
        texts = [cmd.help or "", *(getattr(p, "help", None) or "" for p in cmd.params)]
        brackets = {b.replace("\\[", "[") for t in texts for b in re.findall(r"\\?\[[^\[\]]*\]", t)}
        if not brackets:
            continue
        res = runner.invoke(app, [*argv, "--help"], env={"COLUMNS": "80"})
        assert res.exit_code == 0, res.output
        shown = " ".join(re.sub(r"[│╭╮╰╯─]", " ", res.output).split())
        for b in brackets:
            assert " ".join(b.split()) in shown, (argv, b)
            checked += 1
    assert checked >= 2  # eval's "[brackets]" and its option defaults at least


def test_config_docs_cover_every_key(tmp_path):
    out = tmp_path / "configuration.md"
    assert runner.invoke(app, ["config-docs", "--out", str(out)]).exit_code == 0
    text = out.read_text()
    for key in (
        "rollout.n",
        "algo.kl.coef",
        "train.micro_batch_tokens",
        "data.task_options",
        "algo.correction.mode",
    ):
        assert f"`{key}`" in text


def test_committed_config_reference_is_current():
    from pathlib import Path

    from weir.config.docs import config_reference

    committed = Path(__file__).parents[1] / "docs" / "configuration.md"
    assert committed.read_text() == config_reference(), (
        "run `make docs` to regenerate docs/configuration.md"
    )


def test_committed_compatibility_matrix_is_current_and_every_refusal_says_why():
    from pathlib import Path

    from weir.loop.compat import compatibility_matrix

    text = compatibility_matrix()
    committed = Path(__file__).parents[1] / "docs" / "compatibility.md"
    assert committed.read_text() == text + "\n", (
        "run `make docs` to regenerate docs/compatibility.md"
    )
    refusals = text.split("## Every refusal", 1)[1]
    assert " yet" not in refusals and "not supported" not in refusals
    # what the matrix test runs on Ray (tests/cluster/test_matrix_on_ray.py) is accepted there
    row = {r.split(" | ")[0].lstrip("| "): r for r in text.splitlines() if r.startswith("| ")}
    for feature in ("LoRA, merged weights to the engines", "critic (algo.advantage=gae)"):
        cells = row[feature].split(" | ")
        assert cells[4] == cells[5] == "runs", row[feature]  # Ray with torch, Ray with vLLM


def test_eval_command_writes_metrics(tiny_model_dir, tmp_path):
    import json

    out = tmp_path / "eval.json"
    args = [
        "eval",
        str(tiny_model_dir),
        "--task",
        "arithmetic",
        "--size",
        "12",
        "--n",
        "2",
        "--temperature",
        "1.0",
    ]
    res = runner.invoke(app, [*args, "--max-new-tokens", "4", "--out", str(out)])
    assert res.exit_code == 0, res.output
    metrics = json.loads(out.read_text())
    assert metrics["eval/prompts"] == 12.0
    assert 0.0 <= metrics["eval/pass@1"] <= metrics["eval/pass@2"] <= 1.0


def test_eval_honours_size_on_rows_from_a_file_and_keeps_stderr_clean(tiny_model_dir, tmp_path):
    """`weir eval --data FILE --size N` scores the file's first N rows (it scored them all), and the
    `math` reward's math-verify notice ("Timeout is disabled ...", once per math-verify module and
    process) never reaches stderr. In a process of its own: under pytest, logging has handlers, so
    the notice would not reach stderr anyway."""
    import json
    import subprocess
    import sys

    from weir.tasks.arithmetic import make_rows

    rows = make_rows("test", 10, seed=3)
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval.json"
    args = ["eval", str(tiny_model_dir), "--data", str(data), "--size", "4", "--reward", "math"]
    args += ["--max-new-tokens", "3", "--out", str(out)]
    code = "import sys; from weir.cli.main import app; sys.argv[0] = 'weir'; app()"
    res = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(out.read_text())["eval/prompts"] == 4.0
    assert "the first 4 of the 10 rows" in res.stderr
    assert "Timeout is disabled" not in res.stderr + res.stdout


def test_user_errors_print_a_message_not_a_traceback(tmp_path):
    res = runner.invoke(app, ["eval", str(tmp_path / "missing-model"), "--task", "arithmetic"])
    assert res.exit_code == 1
    assert "no such directory" in res.output and "Traceback" not in res.output
