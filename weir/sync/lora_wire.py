"""What a LoRA run's engines get, built from a trainer rank's FSDP2 shards at sync time.

Two ways, chosen by `lora.sync`:

- ``merged`` (any engine): the base model's tensors under its own names, each adapted weight merged,
  ``W' = W + s B A`` (s = alpha / r, or alpha / sqrt(r) with rslora), computed from the gathered
  W, A and B when its bucket is gathered (`Derived`), so it streams bucket by bucket like any weight
  and no rank holds more than one merged tensor at a time. The same formula and dtype as one
  process (`weir.train.lora.merged_weights`).
- ``adapter`` (vLLM with LoRA enabled): only A and B travel. They are small (2 r (in + out) per
  adapted layer), so rank 0 gathers them whole and writes a peft adapter directory
  (``adapter_config.json``, ``adapter_model.safetensors``) that every server loads through its LoRA
  endpoint; the base weights in the servers never change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from weir.sync.shards import Derived, full_tensor
from weir.train.lora import ADAPTER, ADAPTER_CONFIG, ADAPTER_WEIGHTS, lora_layers


def _merged(weight: torch.Tensor, layer: Any) -> Any:  # a closure per layer: (device) -> W + s B A
    def compute(device: torch.device) -> torch.Tensor:
        w = full_tensor(weight, device)
        a = full_tensor(layer.lora_A[ADAPTER].weight, device)
        b = full_tensor(layer.lora_B[ADAPTER].weight, device)
        return w + (b.float() @ a.float() * layer.scaling[ADAPTER]).to(w.dtype)

    return compute


def merged_wire_state(model: Any) -> dict[str, torch.Tensor | Derived]:
    """The engines' tensors of the (sharded) PeftModel `model` by the base model's names, in its
    ``named_parameters()`` order: adapted weights as `Derived` merges, the rest as they are."""
    layers = dict(lora_layers(model))
    lora_params = {
        id(p)
        for layer in layers.values()
        for p in (*layer.lora_A.parameters(), *layer.lora_B.parameters())
    }
    out: dict[str, torch.Tensor | Derived] = {}
    for name, param in model.get_base_model().named_parameters():
        if id(param) in lora_params:
            continue
        if ".base_layer." not in name:
            out[name] = param
            continue
        prefix, leaf = name.split(".base_layer.", 1)
        if leaf == "weight":
            out[f"{prefix}.weight"] = Derived(
                tuple(param.shape), param.dtype, _merged(param, layers[prefix])
            )
        else:
            out[f"{prefix}.{leaf}"] = param
    return out


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    """A and B of every adapted layer by the names peft saves them under
    (``base_model.model.<layer>.lora_A.weight``); the tensors are the rank's shards."""
    out = {}
    for name, param in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            out[name.replace(f".{ADAPTER}.", ".")] = param
    return out


def write_adapter(model: Any, out: str | Path, device: torch.device, write: bool) -> int:
    """Collective: gather the adapter (tensor by tensor) and, where `write`, save it as a peft
    adapter directory at `out`. Returns its bytes."""
    from safetensors.torch import save_file

    full = {
        k: full_tensor(v, device).to("cpu").contiguous() for k, v in adapter_tensors(model).items()
    }
    if write:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        save_file(full, str(out / ADAPTER_WEIGHTS))
        model.peft_config[ADAPTER].save_pretrained(str(out))
        assert (out / ADAPTER_CONFIG).is_file()
    return sum(t.numel() * t.element_size() for t in full.values())
