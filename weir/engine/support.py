"""Which model architectures weir runs exactly, and how each one takes its attention masks.

The built-in engine decodes with its own KV cache and explicit 4D masks, which HF models use as given.
So every attention feature that lives in the mask (sliding windows, hybrid sliding/full layers) must
be reproduced by the engine, and every feature that does not (soft-capping, sinks, MLA) must be left
to the model's own attention function. This module records, per ``config.model_type``, what the
engine must do, and refuses up front, with `UnsupportedModel`, whatever it cannot do exactly:

- ``single`` models take one mask for all layers; it is a sliding-window mask when
  ``config.sliding_window`` is set (Mistral, Phi-3, Qwen3-MoE: no ``layer_types``);
- ``per_layer_type`` models take a dict ``{layer_type: mask}`` (``full_attention`` /
  ``sliding_attention``, the window being ``config.sliding_window``), as their own forward builds it.

See docs/models.md for the table of architectures, how each was checked, and what is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["SUPPORTED", "ModelSupport", "UnsupportedModel", "check_model_path", "model_support"]


class UnsupportedModel(ValueError):
    """A model weir cannot run exactly; the message names the feature, the architecture and a fix."""


@dataclass(frozen=True)
class _Arch:
    masks: Literal["single", "per_layer_type"]
    packing: bool = True
    """Whether the HF model builds separate masks for packed sequences (position ids restarting)."""
    name: str = ""


SUPPORTED: dict[str, _Arch] = {
    "llama": _Arch("single", name="Llama 3"),
    "qwen2": _Arch("per_layer_type", name="Qwen2 / Qwen2.5"),
    "qwen3": _Arch("per_layer_type", name="Qwen3"),
    "qwen3_moe": _Arch("single", name="Qwen3-MoE"),
    "mistral": _Arch("single", name="Mistral"),
    "phi3": _Arch("single", name="Phi-3"),
    "gemma2": _Arch("per_layer_type", name="Gemma 2"),
    "gemma3_text": _Arch("per_layer_type", name="Gemma 3"),
    "olmo2": _Arch("single", name="OLMo 2"),
    # GptOssModel builds its masks without position_ids, so packed sequences attend to each other.
    "gpt_oss": _Arch("per_layer_type", packing=False, name="GPT-OSS"),
    "deepseek_v3": _Arch("single", name="DeepSeek-V3 (MLA)"),
    # vision-language: the text decoder's masks as qwen2's, the pixels and M-RoPE positions from
    # weir.data.vision_model (packing: 1-D text positions lead the 4-row position ids)
    "qwen2_5_vl": _Arch("per_layer_type", name="Qwen2.5-VL"),
    "qwen3_vl": _Arch("single", name="Qwen3-VL"),  # its text model takes one mask
}

_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass(frozen=True)
class ModelSupport:
    """How the engine feeds masks to one model.

    ``windows`` maps each mask key to its sliding window (None: full causal attention); for a
    ``single`` model the only key is ``""`` and the engine passes a tensor, else a dict by layer type.
    ``packing`` says whether the model is known to keep packed sequences apart (the start-up
    self-check measures it on the actual model either way).
    """

    model_type: str
    name: str
    windows: dict[str, int | None]
    packing: bool

    @property
    def per_layer_type(self) -> bool:
        return "" not in self.windows

    def sliding_windows(self) -> list[int]:
        return sorted({w for w in self.windows.values() if w is not None})


def _refuse(feature: str, model_type: str, fix: str) -> UnsupportedModel:
    return UnsupportedModel(f"unsupported model: {feature} in architecture {model_type!r}; {fix}")


def model_support(config: Any) -> ModelSupport:
    """What the engine must do for the model with HF `config`, or `UnsupportedModel` if weir cannot
    run it exactly (checked before any engine or trainer work)."""
    model_type = str(getattr(config, "model_type", "") or "")
    arch = SUPPORTED.get(model_type)
    if arch is None:
        known = ", ".join(sorted(SUPPORTED))
        raise _refuse(
            "an architecture without a checked engine path",
            model_type or "<no model_type>",
            f"weir runs exactly: {known} (docs/models.md)",
        )
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn not in ("sdpa", "eager"):
        raise _refuse(
            f"attention implementation {attn!r}",
            model_type,
            "load the model with attn_implementation='sdpa' or 'eager'",
        )
    if getattr(config, "attn_logit_softcapping", None) is not None and attn != "eager":
        # HF's sdpa kernel drops soft-capping; only the eager path computes it as the model defines.
        raise _refuse(
            f"attention soft-capping under {attn!r} attention",
            model_type,
            "load the model with attn_implementation='eager'",
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise _refuse("bidirectional attention", model_type, "use a causal (decoder) configuration")
    if getattr(config, "attention_chunk_size", None):
        raise _refuse("chunked attention", model_type, "no fix in weir yet")
    window = getattr(config, "sliding_window", None)
    if window is not None and int(window) < 1:
        raise _refuse(f"sliding_window={window}", model_type, "set a positive window or null")
    if arch.masks == "single":
        if getattr(config, "layer_types", None) and set(config.layer_types) != {"full_attention"}:
            raise _refuse(
                f"per-layer attention types {sorted(set(config.layer_types))}",
                model_type,
                "this architecture's HF class applies one mask to every layer; remove layer_types",
            )
        windows: dict[str, int | None] = {"": int(window) if window is not None else None}
    else:
        types = list(getattr(config, "layer_types", None) or ["full_attention"])
        odd = sorted(set(types) - _LAYER_TYPES)
        if odd:
            raise _refuse(f"layer types {odd}", model_type, "no fix in weir yet")
        if "sliding_attention" in types and window is None:
            raise _refuse(
                "sliding_attention layers without config.sliding_window", model_type, "set it"
            )
        windows = {
            t: (int(window) if t == "sliding_attention" else None) for t in sorted(set(types))
        }
    return ModelSupport(model_type, arch.name, windows, arch.packing)


def check_model_path(path: str) -> None:
    """`model_support` on the config of the model at `path`, before any weights are loaded (the
    attention implementation is only known after loading; `model_support(model.config)` then checks
    it). A path whose config cannot be read is left to the model loader to report."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return
    model_support(config)
