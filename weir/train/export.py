"""`weir export`: a checkpoint (or a run directory) becomes a standard Hugging Face model directory.

A sharded checkpoint (a Ray run's: DCP shards in ``trainer/``) is converted offline, in this one
process (weir.train.sharded_checkpoint.export_sharded)."""

from __future__ import annotations

import json
from pathlib import Path

from weir.train.checkpoint import latest_checkpoint, read_manifest, verify_checkpoint
from weir.train.sharded_checkpoint import export_sharded, is_sharded


def find_model_dir(source: str | Path, *, sharded_ok: bool = False) -> tuple[Path, dict]:
    """The HF directory inside `source` and what it is: a checkpoint (`<ckpt>/model`), a run
    directory (its newest complete checkpoint, else its final `model/`), or an HF directory itself.

    A sharded checkpoint's `model/` has no weights: with `sharded_ok` it is returned all the same
    (origin "sharded": True, for `export_model` to convert); otherwise a run directory falls back
    to its final `model/`, and a checkpoint is refused with the command that converts it."""
    src = Path(source)
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such checkpoint, run directory or model directory")
    if (src / "manifest.json").exists():
        reason = verify_checkpoint(src)
        if reason is not None:
            raise ValueError(f"checkpoint {src} is unusable: {reason}")
        manifest = read_manifest(src)
        origin = {"checkpoint": str(src), "step": manifest["step"]}
        if is_sharded(src):
            if not sharded_ok:
                raise ValueError(
                    f"checkpoint {src} is sharded (a Ray run's); convert it to an HF directory "
                    f"first: weir export {src} --out DIR"
                )
            origin["sharded"] = True
        return src / "model", origin
    if (src / "checkpoints").is_dir():
        ckpt, _ = latest_checkpoint(src / "checkpoints")
        if ckpt is not None and (
            sharded_ok or not is_sharded(ckpt) or not (src / "model").is_dir()
        ):
            return find_model_dir(ckpt, sharded_ok=sharded_ok)
    if (src / "model").is_dir():
        return src / "model", {"run": str(src), "final": True}
    if (src / "config.json").exists():
        return src, {"model": str(src)}
    raise ValueError(
        f"{src} holds no checkpoint (manifest.json), run (checkpoints/ or model/) or HF model (config.json)"
    )


def role_dirs(model_dir: Path) -> list[str]:
    """The roles of a run with multi_agent.policies=separate, whose ``model/`` holds one HF
    directory per role (``model/<role>/config.json``); [] for a one-policy ``model/``."""
    if (model_dir / "config.json").exists() or not model_dir.is_dir():
        return []
    return sorted(p.parent.name for p in model_dir.glob("*/config.json"))


def pick_role(model_dir: Path, origin: dict, role: str | None) -> Path:
    """`model_dir` itself for one policy, its `role`'s directory for per-role policies; a missing
    or unknown `role` is refused naming the roles there."""
    roles = role_dirs(model_dir)
    if not roles:
        if role is not None:
            raise ValueError(f"--role {role}: {model_dir} holds one policy, not one per role")
        return model_dir
    if role not in roles:
        given = "no --role" if role is None else f"--role {role}"
        raise ValueError(
            f"{model_dir} holds a policy per role ({', '.join(roles)}), {given}: pass --role NAME"
        )
    origin["role"] = role
    return model_dir / role


def export_model(
    source: str | Path,
    out: str | Path,
    dtype: str | None = None,
    *,
    adapter: bool = False,
    base: str | None = None,
    role: str | None = None,
) -> Path:
    """Write the model of `source` to `out` as safetensors + config + tokenizer, loadable with
    `AutoModelForCausalLM.from_pretrained(out)`; it is loaded and re-saved, so what is written is
    known to load. `dtype` (float32, bfloat16) converts the weights. A LoRA checkpoint is merged
    into its base model (`base` overrides the one it records), or with `adapter` written as the
    adapter alone (weir.train.lora_export). A run with a policy per role (multi_agent.policies=
    separate) exports the policy of `role`."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )

    from weir.train.lora import is_adapter_dir
    from weir.train.model import DTYPES

    model_dir, origin = find_model_dir(source, sharded_ok=True)
    model_dir = pick_role(model_dir, origin, role)
    if adapter and origin.get("final") and is_adapter_dir(model_dir.parent / "adapter"):
        model_dir = model_dir.parent / "adapter"  # a finished LoRA run: model/ is merged
    if is_adapter_dir(model_dir):
        from weir.train.lora_export import export_lora

        if Path(out).resolve() == model_dir.resolve():
            raise ValueError(f"--out {out} is the source directory; choose another")
        return export_lora(model_dir, Path(out), origin, dtype=dtype, adapter=adapter, base=base)
    if adapter:
        raise ValueError(f"--adapter: {source} was not trained with LoRA (it holds a whole model)")
    if not (model_dir / "config.json").exists():
        raise ValueError(f"{model_dir} is not an HF model directory (no config.json)")
    out = Path(out)
    if out.resolve() == model_dir.resolve():
        raise ValueError(f"--out {out} is the source directory; choose another")
    if origin.get("sharded"):  # DCP shards -> HF files, then loaded back as a check
        export_sharded(origin["checkpoint"], out, dtype)
        AutoModelForCausalLM.from_pretrained(out, dtype="auto")
        (out / "weir_export.json").write_text(json.dumps({"source": origin}, indent=1))
        return out
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
