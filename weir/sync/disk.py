"""The disk transport: versioned safetensors directories, for engines outside the job.

Layout under `root`: ``v000007/model.safetensors`` per version and a ``LATEST`` file naming the
newest. A version is written to a temporary directory and renamed into place, and ``LATEST`` is
replaced atomically after it, so a reader never sees a half-written version.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class DiskStore:
    """Versioned weights in a directory shared by writer and readers.

    Args:
        root: the directory (created if missing).
        keep: how many versions to keep; older ones are deleted after a write.
    """

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = max(1, keep)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def write(self, state: Mapping[str, torch.Tensor], version: int) -> Path:
        """Write `state` as `version` and make it the latest; returns its directory."""
        final = self.path(version)
        tmp = self.root / f".tmp-v{version:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        # safetensors refuses tensors sharing memory (tied embeddings): store each one separately
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
        save_file(tensors, tmp / "model.safetensors", metadata={"version": str(version)})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest = self.root / f".LATEST-{os.getpid()}"
        latest.write_text(str(version))
        os.replace(latest, self.root / "LATEST")
        self._prune(version)
        return final

    def latest(self) -> int | None:
        """The newest complete version, or None if nothing was written yet."""
        f = self.root / "LATEST"
        return int(f.read_text()) if f.exists() else None

    def read(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, tensors) of `version`, or of the latest when None."""
        v = self.latest() if version is None else version
        if v is None:
            raise FileNotFoundError(f"no weights in {self.root} yet (no LATEST file)")
        return v, load_file(self.path(v) / "model.safetensors")

    def _prune(self, newest: int) -> None:
        versions = sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit())
        for v in versions:
            if v <= newest - self.keep:
                shutil.rmtree(self.path(v), ignore_errors=True)
