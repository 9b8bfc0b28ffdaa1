"""`weir export` of a LoRA checkpoint: the merged model as a plain HF directory, or the adapter.

A LoRA run's checkpoint holds only the adapter (``adapter_model.safetensors``, ``adapter_config.json``
and the tokenizer); its ``base_model_name_or_path`` names the base model the adapter was trained on.
Both exports load that base and the adapter with peft, so what is written is known to load:

- merged (default): W + s B A in every adapted layer (`weir.train.lora.merged_weights`), saved as a
  standard model directory that `AutoModelForCausalLM.from_pretrained` loads without peft;
- adapter (``--adapter``): the adapter re-saved by peft, for `peft.PeftModel.from_pretrained(base, out)`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from weir.config.devices import DTYPES
from weir.train.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, merged_model, require_peft


def adapter_base(adapter_dir: Path, base: str | None = None) -> str:
    """The base model of the adapter in `adapter_dir`: `base` if given, else the one it records."""
    recorded = json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    path = base or recorded
    if not path:
        raise ValueError(f"{adapter_dir}: the adapter names no base model; pass --base <model dir>")
    if path.startswith((".", "/", "~")) and not Path(path).expanduser().is_dir():
        raise ValueError(
            f"{adapter_dir}: its base model {path} is not there; pass --base <HF model directory> "
            "(the model the run was trained from)"
        )
    return path


def _adapter_dtype(adapter_dir: Path) -> torch.dtype:
    """The dtype the adapter was trained in (its tensors are small: reading them all is cheap)."""
    from safetensors.torch import load_file

    return next(iter(load_file(adapter_dir / ADAPTER_WEIGHTS).values())).dtype


def export_lora(
    adapter_dir: Path,
    out: Path,
    origin: dict[str, Any],
    *,
    dtype: str | None = None,
    adapter: bool = False,
    base: str | None = None,
) -> Path:
    """Write the LoRA checkpoint's model (`adapter_dir`) to `out`: merged weights, or with
    `adapter` the adapter alone. The base loads in the adapter's dtype (the trainer's master
    dtype), so the merge is the trainer's; `dtype` (float32, bfloat16) converts the result."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    PeftModel = require_peft().PeftModel  # a one-line error naming the extra when peft is missing

    base_path = adapter_base(adapter_dir, base)
    master = _adapter_dtype(adapter_dir)
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=master)
    with warnings.catch_warnings():  # peft asks transformers 5 for a renamed attribute
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        peft_model = PeftModel.from_pretrained(model, adapter_dir)
    out.mkdir(parents=True, exist_ok=True)
    if adapter:
        if dtype is not None:
            peft_model = peft_model.to(DTYPES[dtype])
        peft_model.peft_config["default"].base_model_name_or_path = base_path
        peft_model.save_pretrained(out, safe_serialization=True)
    else:
        plain = merged_model(peft_model)
        if dtype is not None:
            plain = plain.to(DTYPES[dtype])
        plain.config.use_cache = True  # training switches the KV cache off; generation wants it
        plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    what = "lora-adapter" if adapter else "lora-merged"
    (out / "weir_export.json").write_text(
        json.dumps({"source": origin, "kind": what, "base": base_path}, indent=1)
    )
    return out
