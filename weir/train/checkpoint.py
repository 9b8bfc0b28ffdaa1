"""Checkpoints on disk: atomic writes, a manifest with checksums, keep-last-k, and finding the newest good one.

A checkpoint is a directory ``<root>/step_<N>`` written in three moves, so a kill at any instant leaves
either the previous set of checkpoints or the new one, never a half-written directory that looks whole:

1. every file is written into ``<root>/.tmp-step_<N>-<pid>`` and fsynced;
2. ``manifest.json`` (step, files with sizes and SHA-256) is written last, also fsynced;
3. the directory is renamed to ``step_<N>`` (atomic on POSIX) and the parent directory fsynced.

Files may arrive already hashed: the trainer ranks of a sharded checkpoint hash their own shard
files where they wrote them, in parallel (weir.train.sharded_checkpoint); the rest is hashed here,
several files at a time. Every file's entry holds its size, its SHA-256 and a *sampled* hash
(`SAMPLES` blocks of `SAMPLE_BYTES` at evenly spaced offsets). Verification (`verify`):

- ``full``: size and SHA-256 of every byte; catches any corruption, costs reading the checkpoint
  once (an fp32 7B run checkpoint is ~84 GB: a minute or more even with files hashed in parallel);
- ``sampled``: size and the sampled hash; reads 1 MiB per file, so it is instant at any size, and
  catches truncation, torn and unfinished writes and damage in the sampled blocks, but not a bit
  flip elsewhere (DCP's loader still fails on a shard it cannot parse).

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
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1
_NAME = re.compile(r"^step_(\d+)$")
SAMPLES = 16
SAMPLE_BYTES = 1 << 16
VERIFY = ("full", "sampled")


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


def _sampled_sha256(path: Path, size: int) -> str:
    """SHA-256 of `SAMPLES` blocks of `SAMPLE_BYTES` at evenly spaced offsets (the whole file when
    it is smaller than that), prefixed with the size."""
    h = hashlib.sha256(str(size).encode())
    span = SAMPLES * SAMPLE_BYTES
    with open(path, "rb") as f:
        if size <= span:
            h.update(f.read())
        else:
            step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
            for i in range(SAMPLES):
                f.seek(i * step)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def file_entry(path: str | Path) -> dict[str, Any]:
    """A manifest entry: size, SHA-256 and sampled hash of one file."""
    path = Path(path)
    size = path.stat().st_size
    return {"bytes": size, "sha256": _sha256(path), "sampled": _sampled_sha256(path, size)}


def hash_files(paths: list[Path], root: Path, threads: int = 4) -> dict[str, dict[str, Any]]:
    """Manifest entries of `paths` (keyed relative to `root`), several files at a time (hashlib
    releases the GIL while it hashes)."""
    with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
        entries = list(pool.map(file_entry, paths))
    return {p.relative_to(root).as_posix(): e for p, e in zip(paths, entries, strict=True)}


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
    write_files: Callable[[Path], Mapping[str, dict[str, Any]] | None],
    meta: dict[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Write checkpoint `step` atomically; `write_files(dir)` fills the directory. Returns its path.

    `write_files` may return manifest entries (`file_entry`) of files it wrote, fsynced and hashed
    already (a sharded checkpoint's ranks do that in parallel); the other files are fsynced and
    hashed here. An existing checkpoint of the same step is replaced. With `keep`, only the newest
    `keep` complete checkpoints remain afterwards.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    returned = write_files(tmp)
    hashed = dict(returned) if isinstance(returned, Mapping) else {}
    _fault("checkpoint_files", step)
    rest = [
        p
        for p in sorted(q for q in tmp.rglob("*") if q.is_file())
        if p.relative_to(tmp).as_posix() not in hashed
    ]
    for p in rest:
        _fsync(p)
    files = {**hashed, **hash_files(rest, tmp)}
    files = {k: files[k] for k in sorted(files)}
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


def _check(f: Path, name: str, info: dict[str, Any], mode: str) -> str | None:
    if not f.is_file():
        return f"{name} is missing"
    size = f.stat().st_size
    if size != info["bytes"]:
        return f"{name} has {size} bytes, the manifest says {info['bytes']}"
    if mode == "sampled" and "sampled" in info:
        ok = _sampled_sha256(f, size) == info["sampled"]
    else:  # full, or a checkpoint written before sampled hashes existed
        ok = _sha256(f) == info["sha256"]
    return None if ok else f"{name} does not match its checksum"


def verify_checkpoint(path: str | Path, mode: str = "full", threads: int = 4) -> str | None:
    """None if `path` is a complete checkpoint whose files match its manifest, else the reason it is
    not. `mode` is `full` or `sampled` (module docstring); files are checked several at a time."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return "no manifest.json (the write did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        return f"manifest.json is unreadable ({err})"
    if mode not in VERIFY:
        raise ValueError(f"checkpoint verification {mode!r}: use one of {VERIFY}")
    names = sorted(files)
    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        reasons = pool.map(lambda n: _check(path / n, n, files[n], mode), names)
        return next((r for r in reasons if r is not None), None)


def read_manifest(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / MANIFEST).read_text())


def latest_checkpoint(root: str | Path, mode: str = "full") -> tuple[Path | None, list[Broken]]:
    """The newest complete, uncorrupted checkpoint under `root` (or None) and the broken ones newer
    than it; `mode` as in `verify_checkpoint`."""
    broken: list[Broken] = []
    for _, path in reversed(list_checkpoints(root)):
        reason = verify_checkpoint(path, mode)
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
