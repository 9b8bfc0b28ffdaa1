"""GGUF files as `model.path`: converted once into a standard Hugging Face directory, cached by hash.

A GGUF file (llama.cpp's format) holds a model's weights, usually quantized, with its config,
tokenizer and chat template as metadata. transformers reads it (`from_pretrained(...,
gguf_file=...)`, with the `gguf` package: `pip install 'weir[gguf]'`) and dequantizes every tensor;
weir then writes what it read as an ordinary HF directory (float32 safetensors, config, generation
config, tokenizer with its chat template) under ``<cache>/gguf/<name>-<sha256[:16]>/``, so that every
later run, engine and exported checkpoint reads a plain directory. The cache is ``$WEIR_CACHE``, else
``~/.cache/weir``; a file is converted once per cache, whichever process gets there first (a file
lock), and a half-written conversion is never visible (written beside, then renamed).

**The dequantization caveat.** A quantized GGUF's weights are not the model's original weights:
Q4_1, for instance, stores each block of 32 weights as 4-bit integers ``q`` with a float16 scale
``d`` and minimum ``m`` and weir trains ``w = d * q + m`` (exact in float32), the quantized model's
values, which score a little worse than the original bfloat16 weights. The conversion records the
quantization types it found in ``weir_gguf.json`` beside the weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "CACHE_ENV",
    "PROVENANCE",
    "cache_root",
    "convert_gguf",
    "file_sha256",
    "gguf_model_dir",
    "is_gguf",
]

CACHE_ENV = "WEIR_CACHE"
PROVENANCE = "weir_gguf.json"
CONVERTER_VERSION = 2  # bump when the written directory changes: older caches are converted again
CAVEAT = (
    "dequantized from a quantized GGUF: these are the quantized model's weights in float32, not the "
    "original weights (a 4-bit Q4_1 block of 32 is w = d * q + m with float16 d and m), and score a "
    "little worse than the original"
)
_UNQUANTIZED = {"F32", "F16", "BF16", "F64"}


def cache_root() -> Path:
    """weir's cache: ``$WEIR_CACHE``, else ``~/.cache/weir``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "weir"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its ``.gguf`` suffix)."""
    return str(path).lower().endswith(".gguf")


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """The SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _require_gguf(path: Path) -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ValueError(
            f"model.path={str(path)!r} is a GGUF file, which needs the gguf package: "
            "pip install 'weir[gguf]' (or pip install gguf)"
        ) from None


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _converted(out: Path) -> bool:
    try:
        info = json.loads((out / PROVENANCE).read_text())
    except (OSError, ValueError):
        return False
    return info.get("converter_version") == CONVERTER_VERSION and (out / "config.json").is_file()


def gguf_model_dir(
    path: str | Path, cache: str | Path | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """The HF directory converted from the GGUF file at `path`: from the cache when this file (by
    its SHA-256) was converted before, else converted now (`convert_gguf`) and cached; `log` hears
    of a conversion before it starts."""
    src = Path(path).expanduser()
    if not src.is_file():
        raise ValueError(f"model.path={str(path)!r}: no such GGUF file")
    _require_gguf(src)
    digest = file_sha256(src)
    root = Path(cache).expanduser() if cache is not None else cache_root()
    out = root / "gguf" / f"{src.stem}-{digest[:16]}"
    if _converted(out):
        return out
    with _locked(root / "gguf" / f".{out.name}.lock"):
        if _converted(out):  # another process converted it while this one waited
            return out
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        if log is not None:
            log(f"converting {src.name} into an HF directory, once: {out}")
        info = convert_gguf(src, tmp, sha256=digest)
        if log is not None and info["quantized"]:
            log(f"{src.name}: {CAVEAT}")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return out


@contextlib.contextmanager
def _quiet_bars() -> Iterator[None]:
    """No per-tensor progress bar (transformers' GGUF reader draws one) in a log or CI output;
    on a terminal it stays."""
    import sys

    if sys.stderr.isatty() or "TQDM_DISABLE" in os.environ:
        yield
        return
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TQDM_DISABLE", None)


def _tensor_types(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(path).tensors))


def convert_gguf(src: str | Path, out: str | Path, *, sha256: str | None = None) -> dict:
    """Write the GGUF file `src` as an HF directory at `out`; returns (and writes to
    ``out/weir_gguf.json``) where it came from: the file, its SHA-256, the tensor types found,
    whether it was quantized, the caveat, the seconds taken.

    transformers dequantizes the tensors while loading; the loaded model is then copied into a
    fresh model of the same config (a model loaded from a GGUF carries its quantization state and
    is not saved as an ordinary model: transformers refuses to), in float32.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from weir.train.model import save_model

    src, out = Path(src).expanduser(), Path(out)
    _require_gguf(src)
    t0 = time.perf_counter()
    folder, name = str(src.parent), src.name
    try:
        with _quiet_bars():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32
            )
    except (OSError, ValueError, KeyError, NotImplementedError) as err:
        raise ValueError(
            f"cannot convert the GGUF file {str(src)!r}: {type(err).__name__}: {err}. transformers "
            "reads GGUF files of the architectures it lists in its GGUF support"
        ) from None
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)  # the written weights are plain float32
    config = type(loaded.config).from_dict(settings)
    with torch.device("meta"):  # no random init: every weight comes from the loaded model
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    del loaded
    save_model(model, tokenizer, out)
    types = _tensor_types(src)
    info = {
        "converter_version": CONVERTER_VERSION,
        "source": str(src),
        "sha256": sha256 or file_sha256(src),
        "tensor_types": types,
        "quantized": bool(set(types) - _UNQUANTIZED),
        "dtype": "float32",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if info["quantized"]:
        info["caveat"] = CAVEAT
    (out / PROVENANCE).write_text(json.dumps(info, indent=2) + "\n")
    return info
