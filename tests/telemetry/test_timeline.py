"""trace.json has the spans of every phase on the thread (worker) that ran it, and reads back as
the report's timeline lanes."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from weir.telemetry.rundata import load_spans, merge_intervals, overlap, total
from weir.telemetry.timeline import Timeline

TRAIN_PHASES = {"train", "forward", "backward", "optimizer"}


def events_by_thread(run_dir) -> tuple[dict[str, set[str]], dict[str, int]]:
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    phases: dict[str, set[str]] = {}
    for e in events:
        if e["ph"] in ("X", "b"):
            phases.setdefault(names[e["tid"]], set()).add(e["name"])
    return phases, {v: k for k, v in names.items()}


def test_sync_trace_has_every_phase_on_the_thread_that_ran_it(sync_run):
    phases, tids = events_by_thread(sync_run.dir)
    # the sync loop runs every phase in turn on one thread; the engine decodes on its own
    assert set(phases) == {"MainThread", "weir-torch-engine"}
    assert TRAIN_PHASES | {"generate", "reward", "sync", "eval"} <= phases["MainThread"]
    assert phases["weir-torch-engine"] == {"decode"}


def test_async_trace_puts_rollout_and_training_on_their_own_threads(async_run):
    phases, tids = events_by_thread(async_run.dir)
    assert len({tids["MainThread"], tids["weir-rollout"], tids["weir-torch-engine"]}) == 3
    assert TRAIN_PHASES | {"sync", "wait", "eval"} <= phases["MainThread"]
    assert {"generate", "reward", "wait"} <= phases["weir-rollout"]  # wait: for admission
    assert not TRAIN_PHASES & phases["weir-rollout"]
    assert phases["weir-torch-engine"] == {"decode"}


def test_spans_read_back_as_lanes_per_thread(async_run):
    spans = load_spans(async_run.dir / "trace.json")
    lanes = {s.lane for s in spans}
    assert {"MainThread", "MainThread / detail", "weir-rollout / generate"} <= lanes
    assert "weir-torch-engine" in lanes
    assert {s.name for s in spans if s.lane == "MainThread / detail"} >= {"forward", "backward"}
    for lane in lanes:  # merged async spans never overlap within their lane
        mine = sorted((s.start, s.end) for s in spans if s.lane == lane and " / " in lane)
        if lane.endswith(("generate", "reward")):
            assert all(a[1] < b[0] for a, b in zip(mine, mine[1:], strict=False))
    assert all(s.end >= s.start >= 0 for s in spans)


def test_nested_and_overlapping_spans(tmp_path):
    """Build a trace by hand: `train` holds `forward`; two rollout tasks overlap."""
    tl = Timeline(tmp_path / "trace.json")
    with tl.span("train"), tl.span("forward", cat="train"):
        pass
    with tl.async_span("generate", 1), tl.async_span("generate", 2):
        pass
    tl.save()
    spans = load_spans(tmp_path / "trace.json")
    by_name = {(s.lane, s.name) for s in spans}
    assert ("MainThread", "train") in by_name
    assert ("MainThread / detail", "forward") in by_name
    gens = [s for s in spans if s.name == "generate"]
    assert len(gens) == 1 and gens[0].lane == "MainThread / generate"  # two in flight: one bar


def test_back_to_back_spans_merge_within_the_gap(tmp_path, monkeypatch):
    ms = 1_000_000  # ns
    # t0, then (start, end) of three spans: 1-1.5 ms, 2-3 ms (0.5 ms after: merged), 5-6 ms
    clock = iter([0, 1 * ms, ms * 3 // 2, 2 * ms, 3 * ms, 5 * ms, 6 * ms])
    monkeypatch.setattr("weir.telemetry.timeline.time.perf_counter_ns", lambda: next(clock))
    tl = Timeline(tmp_path / "trace.json")
    for _ in range(3):
        with tl.span("decode", cat="engine", merge_gap_ms=0.6):
            pass
    monkeypatch.undo()
    events = [e for e in json.loads(tl.save().read_text())["traceEvents"] if e["ph"] == "X"]
    assert [(e["ts"], e["dur"], e["args"]["merged"]) for e in events] == [
        (1000, 2000, 2),
        (5000, 1000, 1),
    ]


intervals = st.lists(
    st.tuples(st.floats(0, 100), st.floats(0, 10)).map(lambda t: (t[0], t[0] + t[1])), max_size=20
)


@given(intervals)
def test_merged_intervals_are_disjoint_and_cover_the_same_points(ivs):
    merged = merge_intervals(ivs)
    assert all(a[1] < b[0] for a, b in zip(merged, merged[1:], strict=False))
    for start, end in ivs:
        assert any(a <= start and end <= b for a, b in merged)
    assert total(ivs) <= sum(b - a for a, b in ivs) + 1e-9


@given(intervals, intervals)
def test_overlap_is_symmetric_and_bounded(a, b):
    both = overlap(a, b)
    assert abs(both - overlap(b, a)) < 1e-6
    assert -1e-9 <= both <= min(total(a), total(b)) + 1e-6
    assert abs(overlap(a, a) - total(a)) < 1e-6


def test_overlap_worked_example():
    # generation 0-4 and 6-8, training 3-7: they share 3-4 and 6-7
    assert overlap([(0, 4), (6, 8)], [(3, 7)]) == 2
