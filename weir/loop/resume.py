"""Resuming and stopping: which checkpoint to continue from, cutting the metrics back to it, and
turning SIGINT / SIGTERM into "finish the step, checkpoint, exit 0"."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

from weir.config import Config, dump_config
from weir.train.checkpoint import latest_checkpoint, verify_checkpoint


def say(message: str) -> None:
    print(f"weir: {message}", file=sys.stderr, flush=True)


def find_resume(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint to continue from per `run.resume`, or None to start fresh.

    `auto` takes the newest complete checkpoint under <run dir>/checkpoints and reports (and skips) the
    incomplete or corrupt ones newer than it; an explicit path must be a good checkpoint (or a run
    directory that has one).
    """
    spec, mode = cfg.run.resume, cfg.run.checkpoint_verify
    if spec == "never":
        return None
    if spec == "auto":
        path, broken = latest_checkpoint(run_dir / "checkpoints", mode)
        for b in broken:
            say(f"skipping checkpoint {b.path}: {b.reason}")
    else:
        target = Path(spec)
        if (target / "checkpoints").is_dir():
            target = target / "checkpoints"
        if target.is_dir() and not (target / "manifest.json").exists():
            path, broken = latest_checkpoint(target, mode)
            if path is None:
                reasons = "; ".join(f"{b.path.name}: {b.reason}" for b in broken) or "none found"
                raise ValueError(f"run.resume={spec}: no complete checkpoint there ({reasons})")
        else:
            if not target.exists():
                raise FileNotFoundError(f"run.resume={spec}: no such checkpoint directory")
            reason = verify_checkpoint(target, mode)
            if reason is not None:
                raise ValueError(f"run.resume={spec}: this checkpoint is unusable: {reason}")
            path = target
    if path is not None:
        _warn_config_changes(cfg, run_dir)
    return path


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix[:-1]: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def _warn_config_changes(cfg: Config, run_dir: Path) -> None:
    """Exact continuation needs the same config; say which keys differ from the checkpointed run's."""
    saved = run_dir / "config.yaml"
    if not saved.exists():
        return
    old, new = _flat(yaml.safe_load(saved.read_text())), _flat(yaml.safe_load(dump_config(cfg)))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    changed = [k for k in changed if not k.startswith(("telemetry.", "run.resume"))]
    if changed:
        say(
            f"resuming with a changed config ({', '.join(changed[:8])}); the continuation may differ"
        )


def _read_records(path: Path, last_step: int) -> list[dict[str, Any]]:
    """The well-formed records of a metrics file up to `last_step` (a torn last line is dropped)."""
    records = []
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= last_step:
            records.append(record)
    return records


def cut_metrics(run_dir: Path, last_step: int) -> list[dict[str, Any]]:
    """Cut metrics.jsonl (and timings.jsonl) back to the records of steps <= `last_step`, atomically,
    so the resumed run appends exactly what the uninterrupted run would have written next.

    Returns the kept metrics (with timings merged in) as the run's history, without the step key."""
    kept = {}
    for name in ("metrics.jsonl", "timings.jsonl"):
        path = run_dir / name
        records = _read_records(path, last_step)
        if path.exists():
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
            os.replace(tmp, path)
        kept[name] = records
    history = []
    timings = kept["timings.jsonl"]
    for i, record in enumerate(kept["metrics.jsonl"]):
        merged = dict(record)
        if i < len(timings) and timings[i].get("step") == record.get("step"):
            merged.update(timings[i])
        merged.pop("step", None)
        history.append(merged)
    return history


class StopSignal:
    """SIGINT / SIGTERM set `requested`; the loop finishes its step, checkpoints and exits cleanly.

    A second signal stops at once (KeyboardInterrupt); the newest checkpoint is still there to resume.
    Handlers are installed only in the main thread (signal handlers cannot be set elsewhere).
    """

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @classmethod
    def install(cls) -> StopSignal:
        stop = cls()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                stop._previous[sig] = signal.signal(sig, stop._handle)
        return stop

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        say(
            f"{self.signal_name} received: finishing this step, then writing a checkpoint "
            "(send it again to stop at once)"
        )

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
