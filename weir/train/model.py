"""Loading Hugging Face causal LMs (local directory, hub name, GGUF file, `fetch:<name>`, or weir's
`tiny:<size>`) and saving them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from weir.config.devices import DTYPES

ATTENTION = ("sdpa", "eager", "flash_attention_2")


def resolve_model_path(
    path: str, build_dir: str | Path, *, arch: str = "qwen3", seed: int = 0
) -> str:
    """Return a loadable path; `tiny:<size>` builds weir's tiny model under `build_dir` once, and
    `tiny-vlm:<size>` weir's tiny vision-language model (Qwen2.5-VL architecture;
    `tiny-vlm:<size>:qwen3_vl` the same at Qwen3-VL's); a ``.gguf`` file is converted once into a
    cached HF directory (`weir.train.gguf`), and ``fetch:<name>`` fetches a named real model
    (`weir.train.fetch`, e.g. ``fetch:smollm2-135m-instruct``) into the cache on first use."""
    if path.startswith("fetch:"):
        from weir.train.fetch import fetch

        return str(fetch(path.removeprefix("fetch:"), log=_say))
    if path.lower().endswith(".gguf"):
        from weir.train.gguf import gguf_model_dir

        return str(gguf_model_dir(path, log=_say))
    if path.startswith("tiny-vlm:"):
        from weir.tasks.tiny_vlm import build_tiny_vlm

        size, _, vlm_arch = path.split(":", 1)[1].partition(":")
        size, vlm_arch = size or "tiny", vlm_arch or "qwen2_5_vl"
        name = (
            f"tiny-vlm-{size}-seed{seed}"
            if vlm_arch == "qwen2_5_vl"
            else f"tiny-vlm-{size}-{vlm_arch}-seed{seed}"
        )
        out = Path(build_dir) / name
        if not (out / "config.json").exists():
            build_tiny_vlm(out, size=size, seed=seed, arch=vlm_arch)
        return str(out)
    if not path.startswith("tiny:"):
        return path
    from weir.tasks.tiny_model import build_tiny_model

    size = path.split(":", 1)[1] or "tiny"
    out = Path(build_dir) / f"tiny-{size}-{arch}-seed{seed}"
    if not (out / "config.json").exists():
        build_tiny_model(out, size=size, arch=arch, seed=seed)
    return str(out)


def _say(message: str) -> None:
    print(f"weir: {message}", file=sys.stderr, flush=True)


def load_model(
    path: str,
    dtype: str | torch.dtype | None = "float32",
    device: str | torch.device | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer through the standard `from_pretrained` path.

    `dtype` (None: float32) is the parameter dtype; `device` where the model is placed (None: the
    CPU). The attention implementation is the model's own choice when it is one weir runs
    (sdpa, eager, flash_attention_2); anything else is refused.
    """
    if path.startswith((".", "/", "~")) and not Path(path).expanduser().is_dir():
        raise ValueError(
            f"model.path={path!r}: no such directory (expected a Hugging Face model directory)"
        )
    try:
        torch_dtype = DTYPES[dtype or "float32"] if not isinstance(dtype, torch.dtype) else dtype
        if _is_vision_language(path):
            model, tokenizer = _load_vision_language(path, torch_dtype)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except OSError as err:
        raise ValueError(
            f"cannot load model.path={path!r}: {err}. Give a local HF model directory, a hub name "
            "reachable from this machine, or tiny:<nano|tiny|small> for weir's built-in tiny model"
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    if attn not in ATTENTION:
        raise ValueError(
            f"model.path={path!r} uses attn_implementation={attn!r}; weir runs "
            f"{', '.join(ATTENTION)}: set attn_implementation in its config.json"
        )
    if device is not None:
        model = model.to(device)
    return model, tokenizer


def _is_vision_language(path: str) -> bool:
    try:
        return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None
    except (OSError, ValueError):
        return False


def _load_vision_language(path: str, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    """A vision-language model, and its processor's tokenizer with the processor attached
    (`weir.data.vision.processor_of`)."""
    from weir.data.vision import attach_processor
    from weir.data.vision_processor import load_processor

    processor = load_processor(path)
    tokenizer = processor.tokenizer
    attach_processor(tokenizer, processor)
    return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype), tokenizer


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends an assistant turn: the tokenizer's eos plus the generation config's."""
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(extra)
    return sorted(i for i in ids if i is not None)


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path
) -> Path:
    """Write a standard HF directory (safetensors weights, config, tokenizer)."""
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar per checkpoint would flood the run's log
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    from weir.data.vision import processor_of

    processor = processor_of(tokenizer)  # a vision-language model: image processor + tokenizer
    (processor or tokenizer).save_pretrained(out)
    return out
