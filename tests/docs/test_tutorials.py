"""The getting-started, concepts and how-to pages run: their commands, on a CPU, scaled down.

So the docs cannot drift from the code: a renamed key, a changed command or a missing example
fails here. Markers and scaling: tests/docs/tutorials.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.docs.tutorials import blocks, commands, scaled
from weir.cli.main import app
from weir.config import load_config

ROOT = Path(__file__).parents[2]
PAGES = sorted(
    p for d in ("getting-started", "concepts", "how-to") for p in (ROOT / "docs" / d).glob("*.md")
)
runner = CliRunner()


def _weir(argv: list[str]) -> str:
    result = runner.invoke(app, argv[1:])
    if result.exit_code != 0:
        raise AssertionError(
            f"`{' '.join(argv)}` exited {result.exit_code}:\n{result.output[-3000:]}"
        ) from result.exception
    return result.output


def _run(argv: list[str]) -> None:
    if argv[:2] == ["make", "demo"]:  # `make demo` is `make setup` (done) and then `weir demo`
        argv = ["weir", "demo"]
    if argv[0] == "weir":
        _weir(scaled(argv))
    elif argv[0] in ("cat", "ls"):
        for path in argv[1:]:
            assert Path(path).exists(), f"`{' '.join(argv)}`: {path} is not there"
    else:
        raise AssertionError(
            f"`{' '.join(argv)}` in a runnable block: the harness runs weir, make demo, cat and ls; "
            "mark the block `docs-test: config` or `skip REASON`"
        )


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def _extras() -> set[str]:
    from importlib.metadata import metadata

    return set(metadata("weir").get_all("Provides-Extra") or [])


def _check(argv: list[str]) -> None:
    """A command that needs a GPU or a cluster: checked as far as it can be without running it."""
    head = argv[0]
    if head == "weir" and argv[1] == "train":
        _weir([*argv, "--print-config"])
    elif head == "weir" and argv[1] == "sft":
        config = argv[2] if len(argv) > 2 and "=" not in argv[2] else None
        load_config(config, [a for a in argv[2:] if "=" in a])
    elif head == "weir" and argv[1] == "demo":
        from weir.loop.demo import demo_config_path

        task = argv[argv.index("--task") + 1] if "--task" in argv else "arithmetic"
        load_config(demo_config_path(task), [a for a in argv[2:] if "=" in a])
    elif head == "weir":
        _weir([argv[0], argv[1], "--help"])
    elif head == "make":
        assert set(argv[1:]) <= _make_targets(), f"`{' '.join(argv)}`: no such Makefile target"
    elif argv[:2] == ["pip", "install"]:
        for spec in argv[2:]:
            extras = re.fullmatch(r"weir\[([\w,-]+)\]", spec)
            if extras:
                missing = set(extras.group(1).split(",")) - _extras()
                assert not missing, f"`{' '.join(argv)}`: weir has no extra {missing}"
    elif head == "ray":
        assert argv[1] in ("start", "stop", "status"), argv
    elif head in ("python", "bash") or head.startswith("scripts/"):
        script = argv[1] if head in ("python", "bash") else head
        assert (ROOT / script).is_file(), f"`{' '.join(argv)}`: {script} is not there"
    else:
        raise AssertionError(f"`{' '.join(argv)}`: the harness cannot check this command")


def test_every_command_block_is_marked():
    unmarked = [
        f"{page.relative_to(ROOT)}:{b.line}"
        for page in PAGES
        for b in blocks(page)
        if b.kind == "bash" and (not b.mode or (b.mode == "skip" and not b.note))
    ]
    assert not unmarked, (
        "bash blocks without <!-- docs-test: run|config|skip REASON --> before them: "
        + ", ".join(unmarked)
    )


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_page_runs(page, tmp_path, monkeypatch):
    """Each page from the top, in a fresh directory holding the repository's examples/."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.syspath_prepend(str(tmp_path))  # the page's own modules (rewards, tools, envs)
    try:
        _run_page(page, tmp_path)
    finally:  # the page's own modules (my_rewards, ...) go with it
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
                del sys.modules[name]


def _run_page(page: Path, tmp_path: Path) -> None:
    for b in blocks(page):
        if b.kind == "file":
            path = tmp_path / b.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(b.text)
        elif b.mode in ("run", "config"):
            for argv in commands(b.text):
                try:
                    (_run if b.mode == "run" else _check)(argv)
                except AssertionError as err:
                    raise AssertionError(f"{page.relative_to(ROOT)}:{b.line}: {err}") from None
