"""Checkpoints on disk: atomic writes, a manifest with checksums, keep-last-k, and finding the newest good one.

A checkpoint is a directory ``<root>/step_<N>`` written in three moves, so a kill at any instant leaves
either the previous set of checkpoints or the new one, never a half-written directory that looks whole:

1. every file is written into ``<root>/.tmp-step_<N>-<pid>`` and fsynced;
2. ``manifest.json`` (step, files with sizes and SHA-256) is written last, also fsynced;
3. the directory is renamed to ``step_<N>`` (atomic on POSIX) and the parent directory fsynced.

`latest_checkpoint` walks the checkpoints newest first and returns the first whose manifest parses and
whose files match it; the broken ones are returned too, with the reason, so the caller can report them.
What goes *into* a checkpoint is the caller's business (see weir.loop.checkpointing).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1
_NAME = re.compile(r"^step_(\d+)$")


@dataclass
class Broken:
    path: Path
    reason: str


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault(stage: str, step: int) -> None:
    """Fault injection for the kill tests: WEIR_FAULT=<stage>:<step> SIGKILLs this process there."""
    spec = os.environ.get("WEIR_FAULT")
    if spec and spec == f"{stage}:{step}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def write_checkpoint(
    root: str | Path,
    step: int,
    write_files: Callable[[Path], None],
    meta: dict[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Write checkpoint `step` atomically; `write_files(dir)` fills the directory. Returns its path.

    An existing checkpoint of the same step is replaced. With `keep`, only the newest `keep` complete
    checkpoints remain afterwards.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write_files(tmp)
    _fault("checkpoint_files", step)
    files = {}
    for p in sorted(q for q in tmp.rglob("*") if q.is_file()):
        _fsync(p)
        files[p.relative_to(tmp).as_posix()] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    manifest = {"format": FORMAT, "step": step, "time": time.time(), "files": files, **(meta or {})}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    _fault("checkpoint_manifest", step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    if keep is not None:
        prune(root, keep)
    return final


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_N` directory under `root`, oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def verify_checkpoint(path: str | Path) -> str | None:
    """None if `path` is a complete checkpoint whose files match its manifest, else the reason it is not."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return "no manifest.json (the write did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        return f"manifest.json is unreadable ({err})"
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != info["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {info['bytes']}"
        if _sha256(f) != info["sha256"]:
            return f"{name} does not match its checksum"
    return None


def read_manifest(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / MANIFEST).read_text())


def latest_checkpoint(root: str | Path) -> tuple[Path | None, list[Broken]]:
    """The newest complete, uncorrupted checkpoint under `root` (or None) and the broken ones newer than it."""
    broken: list[Broken] = []
    for _, path in reversed(list_checkpoints(root)):
        reason = verify_checkpoint(path)
        if reason is None:
            return path, broken
        broken.append(Broken(path, reason))
    return None, broken


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, plus leftovers of interrupted writes."""
    root = Path(root)
    removed = []
    for p in root.glob(".tmp-step_*"):
        if not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    complete = [p for _, p in list_checkpoints(root) if (p / MANIFEST).exists()]
    for p in complete[: max(0, len(complete) - keep)]:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed
