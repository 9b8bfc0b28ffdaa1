"""Read what a run directory holds back into Python: step metrics, timeline spans, rollout dumps.

The report (weir.telemetry.report) is built from these; they are also handy in a notebook.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def load_metrics(run_dir: str | Path) -> dict[int, dict[str, float]]:
    """Step -> metrics, from metrics.jsonl merged with timings.jsonl (wall-clock metrics of
    deterministic runs) when that exists. Records of the same step are merged, later keys winning;
    null (a NaN that was logged) becomes NaN."""
    run_dir = Path(run_dir)
    steps: dict[int, dict[str, float]] = {}
    for name in ("metrics.jsonl", "timings.jsonl"):
        path = run_dir / name
        if not path.exists():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record.pop("step"))
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{n} is not a metrics record ({err})") from err
            merged = steps.setdefault(step, {})
            for k, v in record.items():
                merged[k] = _number(v)
    return dict(sorted(steps.items()))


def _number(v: Any) -> float:
    if v is None:
        return math.nan
    try:
        return float(v)  # "inf" / "-inf" are written as strings
    except (TypeError, ValueError):
        return math.nan


@dataclass(frozen=True)
class Span:
    """One interval of the timeline, in seconds from the start of the trace."""

    lane: str
    name: str
    cat: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def load_spans(trace_path: str | Path) -> list[Span]:
    """Spans of a Chrome trace written by weir.telemetry.timeline.

    Lanes are named after their thread. Complete ("X") spans nested in another span of the same
    thread (train's forward, backward, optimizer) go to the lane `<thread> / detail`. Async spans
    ("b"/"e": the rollout tasks, many in flight at once) are merged per name into the intervals
    where at least one was running, on the lane `<thread> / <name>`.
    """
    doc = json.loads(Path(trace_path).read_text(encoding="utf-8"))
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    names = {
        (e.get("pid"), e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }

    def thread(e: dict) -> str:
        return names.get((e.get("pid"), e.get("tid")), f"thread {e.get('tid')}")

    spans: list[Span] = []
    complete = sorted(
        (e for e in events if e.get("ph") == "X"), key=lambda e: (e["ts"], -e.get("dur", 0))
    )
    open_until: dict[str, list[float]] = {}
    for e in complete:
        lane, start, end = thread(e), e["ts"] / 1e6, (e["ts"] + e.get("dur", 0)) / 1e6
        stack = open_until.setdefault(lane, [])
        while stack and stack[-1] <= start:
            stack.pop()
        sub = f"{lane} / detail" if stack else lane
        spans.append(Span(sub, e["name"], e.get("cat", ""), start, end))
        stack.append(end)
    begun: dict[tuple, float] = {}
    intervals: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for e in sorted((e for e in events if e.get("ph") in ("b", "e")), key=lambda e: e["ts"]):
        key = (thread(e), e["name"], e.get("cat", ""), e.get("id"))
        if e["ph"] == "b":
            begun[key] = e["ts"] / 1e6
        elif key in begun:
            intervals.setdefault(key[:3], []).append((begun.pop(key), e["ts"] / 1e6))
    for (lane, name, cat), ivs in intervals.items():
        for start, end in merge_intervals(ivs):
            spans.append(Span(f"{lane} / {name}", name, cat, start, end))
    return sorted(spans, key=lambda s: s.start)


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals as disjoint, sorted intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def total(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merge_intervals(intervals))


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds during which some interval of `a` and some interval of `b` both run."""
    a, b = merge_intervals(a), merge_intervals(b)
    i = j = 0
    seconds = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        seconds += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return seconds


def load_rollouts(run_dir: str | Path) -> dict[int, list[dict]] | None:
    """Step -> dumped samples (telemetry.dump_rollouts); None when the run has no dumps."""
    folder = Path(run_dir) / "rollouts"
    files = sorted(folder.glob("step_*.jsonl")) if folder.is_dir() else []
    if not files:
        return None
    out: dict[int, list[dict]] = {}
    for f in files:
        records = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line]
        if records:
            out[int(records[0].get("step", f.stem.removeprefix("step_")))] = records
    return dict(sorted(out.items()))
