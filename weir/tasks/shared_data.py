"""Where a task's data set lives: ``$WEIR_<NAME>_DIR``, else ``../shared/data/<name>`` beside the repo
root or the working directory, else ``data/<name>`` under the working directory. The data sets are
not shipped with weir (GSM8K and HumanEval are read from the shared folder beside a checkout)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["candidates", "find_data_dir"]


def candidates(name: str, env_var: str) -> list[Path]:
    """The directories tried for data set `name`, in order (the environment variable first)."""
    repo_root = Path(__file__).resolve().parents[2]
    out = []
    if os.environ.get(env_var):
        out.append(Path(os.environ[env_var]).expanduser())
    out += [
        repo_root.parent / "shared" / "data" / name,
        Path.cwd().parent / "shared" / "data" / name,
        Path.cwd() / "data" / name,
    ]
    return out


def find_data_dir(
    name: str, env_var: str, files: Sequence[str], tried: list[Path], put: str
) -> Path:
    """The first of `tried` holding any of `files`. An explicit ``$env_var`` must be a directory
    (never silently skipped); otherwise FileNotFoundError lists the places tried and the fix."""
    if os.environ.get(env_var):
        if not tried[0].is_dir():
            raise FileNotFoundError(f"{name}: ${env_var}={str(tried[0])!r} is not a directory")
        return tried[0]
    for path in tried:
        if any((path / f).is_file() for f in files):
            return path
    raise FileNotFoundError(
        f"{name}: no data directory found; tried "
        + ", ".join(str(p) for p in tried)
        + f". Put {put} in one of them, set ${env_var}, or pass data_dir="
    )
