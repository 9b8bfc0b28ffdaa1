"""GSM8K grade-school math word problems, read from local JSONL files (nothing is downloaded).

Expects ``{data_dir}/train.jsonl`` and ``{data_dir}/test.jsonl`` in the original format:
``{"question": ..., "answer": "<worked solution>\\n#### 42"}``.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from weir.data.sources import read_jsonl
from weir.tasks.shared_data import candidates, find_data_dir

__all__ = [
    "make_rows",
    "sft_rows",
    "default_data_dir",
    "final_answer",
    "REWARD",
    "DESCRIPTION",
    "DEFAULT_INSTRUCTION",
]

REWARD = "math"
DESCRIPTION = "GSM8K grade-school math (local JSONL); answer after '####', scored with math-verify"
DEFAULT_INSTRUCTION = "Give the final answer after ####."
ENV_VAR = "WEIR_GSM8K_DIR"
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def _candidates() -> list[Path]:
    return candidates("gsm8k", ENV_VAR)


def default_data_dir() -> Path:
    """The GSM8K directory: ``$WEIR_GSM8K_DIR``, else ``../shared/data/gsm8k`` next to the repo
    root, else ``../shared/data/gsm8k`` or ``data/gsm8k`` under the working directory.

    Raises FileNotFoundError listing the places tried.
    """
    return find_data_dir(
        "gsm8k", ENV_VAR, ("train.jsonl", "test.jsonl"), _candidates(), "train.jsonl/test.jsonl"
    )


def final_answer(solution: str) -> str:
    """The number after the last ``####`` of a GSM8K solution, thousands separators removed."""
    if "####" not in solution:
        raise ValueError(f"gsm8k: solution has no '####' final answer: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def make_rows(
    split: str,
    n: int | None = None,
    seed: int = 0,
    *,
    data_dir: str | Path | None = None,
    instruction: str | None = DEFAULT_INSTRUCTION,
) -> list[dict[str, Any]]:
    """Rows of `split` (``"train"`` or ``"test"``): ``prompt`` = question + newline + `instruction`
    (no suffix when `instruction` is empty/None), ``answer`` = the final number, ``solution`` =
    the original worked solution, ``question``.

    ``n=None`` (or ``n >= size``) gives every row in file order; a smaller `n` gives a seeded
    random subset, still in file order.
    """
    if split not in ("train", "test"):
        raise ValueError(f"gsm8k: split must be 'train' or 'test', got {split!r}")
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    path = root / f"{split}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"gsm8k: {path} does not exist")
    raw = read_jsonl(path)
    rows = []
    for lineno, r in enumerate(raw, start=1):
        if "question" not in r or "answer" not in r:
            raise ValueError(
                f"{path}:{lineno}: a GSM8K row needs 'question' and 'answer'; has {sorted(r)}"
            )
        question = str(r["question"]).strip()
        prompt = f"{question}\n{instruction}" if instruction else question
        rows.append(
            {
                "prompt": prompt,
                "answer": final_answer(r["answer"]),
                "solution": r["answer"],
                "question": question,
                "task": "gsm8k",
            }
        )
    if n is not None and n < len(rows):
        keep = sorted(random.Random(f"gsm8k:{split}:{seed}").sample(range(len(rows)), n))
        rows = [rows[i] for i in keep]
    return rows


def sft_rows(
    n: int | None,
    seed: int,
    *,
    strip_calculator: bool = True,
    **opts: Any,
) -> list[dict[str, Any]]:
    """Train rows with ``"response"`` = the worked solution (ending ``#### N``), with the
    ``<<48/2=24>>`` calculator annotations removed unless ``strip_calculator=False``."""
    rows = make_rows("train", n, seed, **opts)
    for row in rows:
        solution = row["solution"]
        row["response"] = _CALCULATOR.sub("", solution) if strip_calculator else solution
    return rows
