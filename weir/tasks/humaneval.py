"""HumanEval (Chen et al. 2021): 164 Python problems with unit tests, an evaluation set.

Read from a local ``HumanEval.jsonl.gz`` (or ``.jsonl``) in the original format (``task_id``,
``prompt``, ``entry_point``, ``canonical_solution``, ``test``); nothing is downloaded. Each row's
single test is the problem's ``check`` function called on the entry point, run after the program by
the `code_tests` reward (all-or-nothing, as HumanEval scores), so ``weir eval MODEL --task humaneval
--n 10 --temperature 0.8`` reports pass@1 and pass@k.

Two prompt styles: ``instruct`` (default, for chat models) asks for the whole function in a
```` ```python ```` block; ``completion`` (with ``data.chat_template=false``, for base models) is
the bare code prompt, the response is its continuation, cut at HumanEval's stop strings. Either way
the problem's prompt is put before the program (``prefix``), so a response may complete the body or
restate the whole function.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

from weir.tasks.shared_data import candidates, find_data_dir

__all__ = ["make_rows", "sft_rows", "default_data_dir", "load_problems", "REWARD", "DESCRIPTION"]

REWARD = "code_tests"
DESCRIPTION = "HumanEval: 164 Python functions to complete, scored by their unit tests (eval only)"
ENV_VAR = "WEIR_HUMANEVAL_DIR"
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]
INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a "
    "```python code block.\n\n```python\n{prompt}```"
)
_FILES = ("HumanEval.jsonl.gz", "HumanEval.jsonl")


def _candidates() -> list[Path]:
    return candidates("humaneval", ENV_VAR)


def default_data_dir() -> Path:
    """The HumanEval directory: ``$WEIR_HUMANEVAL_DIR``, else ``../shared/data/humaneval`` next to
    the repo root, else ``../shared/data/humaneval`` or ``data/humaneval`` under the working
    directory. Raises FileNotFoundError listing the places tried."""
    return find_data_dir("humaneval", ENV_VAR, _FILES, _candidates(), "HumanEval.jsonl.gz")


def load_problems(data_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """The raw problems in file order; ValueError naming the line of a malformed one."""
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    path = next((root / f for f in _FILES if (root / f).is_file()), None)
    if path is None:
        raise FileNotFoundError(f"humaneval: no {' or '.join(_FILES)} in {root}")
    opener = gzip.open if path.suffix == ".gz" else open
    problems = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            p = json.loads(line)
            missing = {"task_id", "prompt", "entry_point", "test"} - set(p)
            if missing:
                raise ValueError(f"{path}:{lineno}: a HumanEval problem needs {sorted(missing)}")
            problems.append(p)
    return problems


def make_rows(
    split: str,
    n: int | None = None,
    seed: int = 0,
    *,
    data_dir: str | Path | None = None,
    style: str = "instruct",
) -> list[dict[str, Any]]:
    """Rows of the ``test`` split (HumanEval has no other): ``prompt`` (per `style`), ``prefix``
    (the problem's code prompt), ``tests`` (``[test + "check(entry_point)"]``), ``stop``,
    ``entry_point``, ``task_id`` and ``answer`` (the canonical solution body).

    ``n=None`` (or ``n >= 164``) gives every problem in file order; a smaller `n` a seeded subset.
    """
    if split != "test":
        raise ValueError(
            f"humaneval is an evaluation set with only a 'test' split (got {split!r}); use it with "
            "`weir eval MODEL --task humaneval` or as data.eval_source beside your training data"
        )
    if style not in ("instruct", "completion"):
        raise ValueError(f"humaneval: style must be 'instruct' or 'completion', got {style!r}")
    rows = []
    for p in load_problems(data_dir):
        rows.append(
            {
                "prompt": INSTRUCTION.format(prompt=p["prompt"])
                if style == "instruct"
                else p["prompt"],
                "prefix": p["prompt"],
                "tests": [f"{p['test']}\ncheck({p['entry_point']})\n"],
                "stop": STOP,
                "entry_point": p["entry_point"],
                "task_id": p["task_id"],
                "answer": p.get("canonical_solution", ""),
                "task": "humaneval",
            }
        )
    if n is not None and n < len(rows):
        keep = sorted(random.Random(f"humaneval:{seed}").sample(range(len(rows)), n))
        rows = [rows[i] for i in keep]
    return rows


def sft_rows(n: int | None, seed: int, **opts: Any) -> list[dict[str, Any]]:
    """HumanEval is for evaluation only: training on it would leak the test set."""
    raise ValueError(
        "humaneval is an evaluation set: it has no SFT rows (training on it would leak the test); "
        "use it with `weir eval` or data.eval_source"
    )
