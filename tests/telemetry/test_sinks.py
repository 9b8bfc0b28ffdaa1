"""Console output (live on a terminal, plain lines in logs) and the Weights & Biases sink."""

from __future__ import annotations

import io
import struct
import sys
import time

import pytest
from rich.console import Console

from weir.config import build_config
from weir.loop.run import Run
from weir.telemetry import ConsoleSink, WandbSink, console_sink
from weir.telemetry.console import ProgressSink
from weir.telemetry.sinks import EtaClock, time_split

STEP = {
    "reward/mean": 0.5,
    "response/length_mean": 3.25,
    "throughput/gen_tokens_per_s": 1234.4,
    "time/step": 4.0,
    "time/generate": 2.0,
    "time/train": 1.0,
    "time/sync": 0.2,
}


def console(terminal: bool) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=terminal, width=200, highlight=False), buf


def test_plain_lines_off_a_terminal():
    con, buf = console(terminal=False)
    sink = console_sink(10, "auto", con)
    assert type(sink) is ConsoleSink
    sink.write(1, STEP)
    sink.write(2, {**STEP, "reward/mean": 0.75})
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 1/10  reward 0.500  len 3.2")  # 3.25 rounds half to even
    assert "gen tok/s 1234" in lines[0]
    assert "time gen 50% train 25% sync 5%" in lines[0]
    assert lines[1].startswith("step 2/10  eta ") and "reward 0.750" in lines[1]
    assert "\x1b[" not in buf.getvalue()  # no terminal escape codes in logs


def test_time_split_is_each_phase_share_of_the_step():
    assert time_split({"time/step": 2.0, "time/train": 0.5, "time/wait_for_batch": 1.5}) == (
        "wait 75% train 25%"
    )
    assert time_split({"time/train": 0.5}) == ""  # no step time: nothing to split


def test_eta_is_mean_step_time_times_steps_left(monkeypatch):
    now = iter([100.0, 104.0, 108.0])
    monkeypatch.setattr("weir.telemetry.sinks.time.perf_counter", lambda: next(now))
    eta = EtaClock(total=10)
    assert eta.update(0) is None  # no step finished yet
    assert eta.update(2) == pytest.approx(4.0 / 2 * 8)
    assert eta.update(4) == pytest.approx(8.0 / 4 * 6)


def test_live_progress_on_a_terminal():
    con, buf = console(terminal=True)
    sink = console_sink(4, "auto", con)
    assert isinstance(sink, ProgressSink)
    sink.write(0, {"eval/accuracy": 0.25, "eval/reward": 0.5, "time/step": 1.0})
    sink.write(2, STEP)
    sink.close()
    out = buf.getvalue()
    assert "step 0/4  eval  accuracy 0.250  reward 0.500" in out  # evals stay in the scrollback
    assert "step 2/4" in out and "reward 0.500" in out and "gen 50% train 25% sync 5%" in out
    assert "eta" in out


def test_style_can_be_forced_either_way():
    con, _ = console(terminal=False)
    live = console_sink(3, "live", con)
    live.close()
    assert isinstance(live, ProgressSink)
    con, _ = console(terminal=True)
    assert type(console_sink(3, "lines", con)) is ConsoleSink


# -- Weights & Biases -----------------------------------------------------------------------------


def wandb_history(run_dir, steps: int) -> list[dict]:
    """History rows of an offline W&B run; waits (up to 30 s) for `steps` rows, since the wandb-core
    service may still be writing the file when `finish()` returns."""
    deadline = time.monotonic() + 30
    while True:
        rows = read_wandb_log(run_dir)
        if len(rows) >= steps or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def read_wandb_log(run_dir) -> list[dict]:
    """History rows from the run's transaction log (.wandb): a LevelDB-style log of 32 KiB
    blocks of records (crc32, length, type; then a protobuf `Record`). The wandb-core service may
    still be writing it, so a truncated or half-written last record ends the read early."""
    import json

    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    paths = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    if not paths:
        return []
    (path,) = paths
    data = path.read_bytes()
    if len(data) < 7:
        return []
    assert data[:4] == b":W&B"
    pos, block, rows, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):  # the writer is still appending this record
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full record, or the last piece of one
            record = pb.Record()
            try:
                record.ParseFromString(pending)
            except DecodeError:  # a tail the writer has not finished; the caller reads again
                break
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in record.history.item
                    }
                )
    return rows


def test_wandb_offline_run_holds_the_step_metrics(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sink = WandbSink(tmp_path, project="weir-test", name="t", config={"a": 1}, mode="offline")
    sink.write(0, {"eval/accuracy": 0.25})
    sink.write(1, {"reward/mean": 0.5, "train/loss": float("nan")})
    sink.write(2, {"reward/mean": 0.75})
    sink.close()
    rows = wandb_history(tmp_path, steps=3)
    by_step = {r["_step"]: r for r in rows}
    assert by_step[0]["eval/accuracy"] == 0.25
    assert by_step[1]["reward/mean"] == 0.5 and "train/loss" not in by_step[1]  # NaN left out
    assert by_step[2]["reward/mean"] == 0.75


def test_telemetry_wandb_in_the_config_opens_the_sink(tmp_path):
    cfg = build_config(
        {"data": {"task": "arithmetic"}, "telemetry": {"console": False, "wandb": True}},
        [f"run.dir={tmp_path}", "run.name=cfg-test"],
    )
    run = Run.open(cfg)
    run.log(1, {"reward/mean": 0.125})
    run.close()
    assert any(
        r.get("reward/mean") == 0.125 and r["_step"] == 1 for r in wandb_history(tmp_path, steps=1)
    )


def test_wandb_missing_is_a_one_line_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'weir\[wandb\]'"):
        WandbSink(tmp_path, project="p", name="n")
