"""Start a trainer rank without the whole model, and write an HF directory from the shards.

A rank builds the model with its parameters on the meta device (no memory), shards it with
FSDP2, allocates only its own shard (`materialize`) and reads only its slice of every weight from
the model's safetensors files (`load_local_shards`). Peak memory of a rank's start is its shard
plus one tensor slice, not the whole model: N ranks of a 7B model in fp32 hold 28/N GB each.

This works when the names and shapes the module holds are the names and shapes on disk, which is
true of the dense architectures weir runs; a model whose loading converts weights (transformers'
key renaming or fusing, e.g. Qwen3-MoE's experts: one tensor per expert on disk, fused in
memory) is loaded whole on each rank instead (`layout_mismatch` says why), exactly as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
)

from weir.train.model import ATTENTION

INDEX = "model.safetensors.index.json"


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block every parameter a module registers is moved to the meta device.

    Buffers stay real: non-persistent ones (rotary frequencies) are computed in `__init__` and
    are not in the checkpoint. The initialisers that modules run on their parameters after
    registering them act on meta tensors and cost nothing. The patch is process-wide while the
    block runs: build nothing else in another thread meanwhile (ranks and the driver build their
    model before any thread starts).
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_on_meta(model_path: str, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM of `model_path` (a local HF directory) with its parameters on the meta device,
    configured as `weir.train.model.load_model` configures a loaded one."""
    config = AutoConfig.from_pretrained(model_path)
    vision = getattr(config, "vision_config", None) is not None  # a vision-language model
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    with parameters_on_meta():
        model = auto.from_config(config, dtype=dtype)
    model.config.use_cache = False
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    if attn not in ATTENTION:
        raise ValueError(
            f"model.path={model_path!r} uses attn_implementation={attn!r}; weir runs "
            f"{', '.join(ATTENTION)}: set attn_implementation in its config.json"
        )
    return model.train()


def driver_model(model_path: str, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    """Config, generation config and tokenizer without any weights: what the driver of a Ray run
    needs (its ranks and engines load the weights themselves). A vision-language model's tokenizer
    comes with its processor attached (`weir.data.vision.processor_of`), as `load_model` gives it."""
    model = build_on_meta(model_path, dtype)
    if getattr(model.config, "vision_config", None) is not None:
        from weir.data.vision import attach_processor
        from weir.data.vision_processor import load_processor

        processor = load_processor(model_path)
        tokenizer = processor.tokenizer
        attach_processor(tokenizer, processor)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return model, tokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def disk_layout(model_dir: str | Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """{tensor name: (safetensors file, shape)} of an HF directory, read from the file headers."""
    layout: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                layout[name] = (file, tuple(f.get_slice(name).get_shape()))
    return layout


def saved_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an HF directory of `model` holds when no conversion applies: every parameter once (a
    tied one under its first name) and every persistent buffer."""
    out = dict(model.named_parameters())
    non_persistent = {
        f"{prefix}.{b}" if prefix else b
        for prefix, m in model.named_modules()
        for b in m._non_persistent_buffers_set
    }
    out.update((k, v) for k, v in model.named_buffers() if k not in non_persistent)
    return out


def layout_mismatch(
    model: nn.Module, layout: dict[str, tuple[Path, tuple[int, ...]]]
) -> str | None:
    """None when every tensor of `model` is on disk under its own name and shape, else why not."""
    if not layout:
        return "no *.safetensors files"
    for name, t in saved_tensors(model).items():
        if name not in layout:
            return f"{name} is not in the safetensors files (the loader converts names)"
        if tuple(t.shape) != layout[name][1]:
            return f"{name} has shape {tuple(t.shape)} in memory, {layout[name][1]} on disk"
    return None


def materialize(model: nn.Module, device: str | torch.device) -> None:
    """Allocate the (sharded) meta parameters on `device`, keeping the buffers' values.

    `to_empty` replaces buffers with uninitialised memory too; they are small and were computed
    at construction, so they are copied back. On an unsharded model it also gives each module a
    parameter of its own where modules shared one (a tied embedding and LM head): the ties are
    made again.
    """
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)
    for (first, first_name), *others in places.values():
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def _local(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's part of `t` and where it lies in the full tensor (all of it if not a DTensor)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def load_local_shards(model: nn.Module, layout: dict[str, tuple[Path, tuple[int, ...]]]) -> int:
    """Copy this rank's slice of every saved tensor from disk into `model`; returns bytes read.

    Each file is opened for one tensor and closed again, so the pages of the memory map do not
    add up to the whole file: the peak is the rank's shard plus one slice.
    """
    read = 0
    with torch.no_grad():
        for name, t in saved_tensors(model).items():
            local, where = _local(t)
            if local.numel() == 0:
                continue
            with safe_open(layout[name][0], framework="pt") as f:
                part = f.get_slice(name)[where]
                local.copy_(part.view(local.shape))
                read += part.numel() * part.element_size()
                del part
    return read


def write_hf_weights(
    model: nn.Module | None,
    out_dir: str | Path,
    *,
    write: bool,
    bucket_bytes: int,
    tensors: dict[str, Any] | None = None,
    full: Any = None,
) -> list[str]:
    """Collective over the ranks sharding `model`: gather one tensor at a time; the rank with
    `write` packs them into safetensors files of about `bucket_bytes` (with the HF index when there
    are several). Peak memory on the writer: its shard plus one bucket. Returns the files written.

    `tensors` (name -> shard) replaces `model`'s own with `full(t)` gathering each (e.g. a LoRA
    model's merged weights, weir.sync.lora_wire).
    """
    out = Path(out_dir)
    bucket: dict[str, torch.Tensor] = {}
    size, total, parts, weight_map = 0, 0, [], {}

    def flush() -> None:
        nonlocal bucket, size
        if bucket:
            name = f"part-{len(parts):05d}.safetensors"
            save_file(bucket, str(out / name), metadata={"format": "pt"})
            parts.append(name)
            weight_map.update(dict.fromkeys(bucket, name))
        bucket, size = {}, 0

    if write:
        out.mkdir(parents=True, exist_ok=True)
    items = tensors if tensors is not None else saved_tensors(model)
    for name, t in items.items():
        whole = full(t) if full is not None else t.full_tensor() if hasattr(t, "full_tensor") else t
        if write:
            bucket[name] = whole.detach().to("cpu").contiguous().clone()
            size += bucket[name].nbytes
            total += bucket[name].nbytes
            if size >= bucket_bytes:
                flush()
        del whole
    if not write:
        return []
    flush()
    if len(parts) == 1:
        (out / parts[0]).rename(out / "model.safetensors")
        return ["model.safetensors"]
    names = {p: f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i, p in enumerate(parts)}
    for old, new in names.items():
        (out / old).rename(out / new)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: names[v] for k, v in sorted(weight_map.items())},
    }
    (out / INDEX).write_text(json.dumps(index, indent=1))
    return [*names.values(), INDEX]
