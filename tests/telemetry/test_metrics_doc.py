"""docs/metrics.md names every metric a run writes, so the page cannot drift from the code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import weir

DOC = Path(__file__).parents[2] / "docs" / "metrics.md"


def documented() -> list[str]:
    """Metric names in the first column of the doc's tables (`<k>` stands for a number)."""
    return re.findall(r"^\| `([^`]+)` \|", DOC.read_text(), flags=re.MULTILINE)


def pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.escape(name).replace(re.escape("<k>"), r"\d+") + "$")


def keys_written(run_dir: Path) -> set[str]:
    keys: set[str] = set()
    for name in ("metrics.jsonl", "timings.jsonl"):
        path = run_dir / name
        if path.exists():
            for line in path.read_text().splitlines():
                keys |= set(json.loads(line)) - {"step"}
    return keys


def undocumented(keys: set[str]) -> list[str]:
    patterns = [pattern(n) for n in documented()]
    return sorted(k for k in keys if not any(p.match(k) for p in patterns))


def test_doc_lists_each_name_once():
    names = documented()
    assert len(names) > 60
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]


def test_name_patterns_match_numbers_only():
    p = pattern("staleness/hist_<k>")
    assert p.match("staleness/hist_0") and p.match("staleness/hist_12")
    assert not p.match("staleness/hist_x") and not p.match("staleness/hist_")


def test_every_metric_of_sync_and_async_runs_is_documented(sync_run, async_run):
    keys = keys_written(sync_run.dir) | keys_written(async_run.dir)
    # the runs exercise KL, correction, pass@k and async-only metrics: the check covers them
    for expected in (
        "kl/ref",
        "correction/ratio_mean",
        "eval/pass@2",
        "buffer/depth",
        "time/wait_for_batch",
    ):
        assert expected in keys
    assert undocumented(keys) == []


def test_every_metric_of_an_sft_run_is_documented(tmp_path):
    weir.sft(
        {
            "model": {"path": "tiny:nano", "threads": 1},
            "data": {"task": "arithmetic"},
            "sft": {"rows": 32, "batch_size": 16},
            "telemetry": {"console": False},
        },
        [f"run.dir={tmp_path}"],
    )
    keys = keys_written(tmp_path)
    assert "sft/loss" in keys
    assert undocumented(keys) == []


def test_an_unknown_name_is_reported():
    assert undocumented({"reward/mean", "reward/mystery"}) == ["reward/mystery"]
