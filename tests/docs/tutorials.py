"""Reading the runnable parts of the docs: fenced ```bash blocks and the files they need.

A bash block on a getting-started, concepts or how-to page carries a marker in an HTML comment on
the line before it (invisible on GitHub and on the site):

- ``<!-- docs-test: run -->``: its commands run, on a CPU, scaled down (`SCALE_DOWN`: the sizes of a
  step, never the keys the command itself sets);
- ``<!-- docs-test: config -->``: GPU or cluster commands; each `weir train` is checked with
  `--print-config`, each other command for what can be checked without running it;
- ``<!-- docs-test: skip REASON -->``: neither, for a reason given.

A fenced block with ``title="PATH"`` (MkDocs Material shows it as the block's title) is a file the
page asks the reader to write: it is written to PATH before the commands that follow it run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"<!--\s*docs-test:\s*(run|config|skip)\b(.*?)-->", re.DOTALL)
TITLE = re.compile(r'title="([^"]+)"')

# Sizes of a step for a run block; a key the command sets itself is left as the page says.
SCALE_DOWN = {
    "run.steps": "2",
    "run.eval_every": "0",
    "rollout.batch_prompts": "4",
    "rollout.n": "4",
    "data.train_size": "64",
    "data.eval_size": "8",
    "sft.rows": "64",
    "sft.epochs": "1",
    "model.threads": "1",
    "telemetry.console": "false",
}
TAKES_OVERRIDES = {"train", "sft", "demo"}


@dataclass
class Block:
    kind: str  # "file" or "bash"
    text: str
    mode: str = ""  # run | config | skip | "" (unmarked)
    note: str = ""
    path: str = ""  # a file block's title
    line: int = 0


def blocks(page: Path) -> list[Block]:
    """The page's bash blocks (with their markers) and titled files, in the order they appear."""
    text = page.read_text()
    out, last_end = [], 0
    for m in FENCE.finditer(text):
        lang, info, body = m.group(1), m.group(2), m.group(3)
        line = text.count("\n", 0, m.start()) + 1
        between = text[last_end : m.start()]
        last_end = m.end()
        title = TITLE.search(info)
        if title:
            out.append(Block("file", body, path=title.group(1), line=line))
        elif lang in ("bash", "sh", "shell"):
            mark = None
            tail = between.rstrip()
            for mk in MARKER.finditer(between):
                if tail.endswith(mk.group(0)):
                    mark = mk
            mode, note = (mark.group(1), mark.group(2).strip()) if mark else ("", "")
            out.append(Block("bash", body, mode=mode, note=note, line=line))
    return out


def commands(script: str) -> list[list[str]]:
    """The block's commands as argument lists: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", script)
    out = []
    for line in joined.splitlines():
        for part in line.split(";"):
            argv = shlex.split(part, comments=True)
            if argv:
                out.append(argv)
    return out


def overrides_set(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if "=" in a and not a.startswith("-")}


def scaled(argv: list[str]) -> list[str]:
    """A `weir train|sft|demo|eval` command with the step sizes of SCALE_DOWN added."""
    sub = argv[1]
    if sub in TAKES_OVERRIDES:
        given = overrides_set(argv)
        return argv + [f"{k}={v}" for k, v in SCALE_DOWN.items() if k not in given]
    if sub == "eval" and "--size" not in argv:
        return argv + ["--size", "8"]
    return argv
