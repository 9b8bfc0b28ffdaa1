"""`weir export`: a checkpoint (or a run directory) becomes a standard Hugging Face model directory."""

from __future__ import annotations

import json
from pathlib import Path

from weir.train.checkpoint import latest_checkpoint, read_manifest, verify_checkpoint


def find_model_dir(source: str | Path) -> tuple[Path, dict]:
    """The HF directory inside `source` and what it is: a checkpoint (`<ckpt>/model`), a run
    directory (its newest complete checkpoint, else its final `model/`), or an HF directory itself."""
    src = Path(source)
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such checkpoint, run directory or model directory")
    if (src / "manifest.json").exists():
        reason = verify_checkpoint(src)
        if reason is not None:
            raise ValueError(f"checkpoint {src} is unusable: {reason}")
        manifest = read_manifest(src)
        return src / "model", {"checkpoint": str(src), "step": manifest["step"]}
    if (src / "checkpoints").is_dir():
        ckpt, _ = latest_checkpoint(src / "checkpoints")
        if ckpt is not None:
            return find_model_dir(ckpt)
    if (src / "model").is_dir():
        return src / "model", {"run": str(src), "final": True}
    if (src / "config.json").exists():
        return src, {"model": str(src)}
    raise ValueError(
        f"{src} holds no checkpoint (manifest.json), run (checkpoints/ or model/) or HF model (config.json)"
    )


def export_model(source: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write the model of `source` to `out` as safetensors + config + tokenizer, loadable with
    `AutoModelForCausalLM.from_pretrained(out)`; it is loaded and re-saved, so what is written is
    known to load. `dtype` (float32, bfloat16) converts the weights."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )

    from weir.train.model import DTYPES

    model_dir, origin = find_model_dir(source)
    if not (model_dir / "config.json").exists():
        raise ValueError(f"{model_dir} is not an HF model directory (no config.json)")
    out = Path(out)
    if out.resolve() == model_dir.resolve():
        raise ValueError(f"--out {out} is the source directory; choose another")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = None  # a vision-language model: its image processor goes along
    auto = AutoModelForCausalLM
    if getattr(AutoConfig.from_pretrained(model_dir), "vision_config", None) is not None:
        from weir.data.vision_processor import load_processor

        processor, auto = load_processor(model_dir), AutoModelForImageTextToText
    model = auto.from_pretrained(model_dir, dtype=DTYPES[dtype] if dtype else "auto")
    model.config.use_cache = True  # training switches the KV cache off; generation wants it
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (processor or tokenizer).save_pretrained(out)
    (out / "weir_export.json").write_text(json.dumps({"source": origin}, indent=1))
    return out
