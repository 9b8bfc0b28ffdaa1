"""Small random-init models of real architectures (Llama, Qwen, Mistral, Phi-3, Gemma, OLMo 2,
GPT-OSS, DeepSeek-V3), with weir's byte-level tokenizer, saved as standard HF directories.

They exist to check, on every architecture weir claims, that engine and trainer compute what a plain
HF forward computes: each is a few layers wide enough to run in a fraction of a second, with a small
sliding window (8) where the architecture has one so that a 40-token sequence goes well past it, and
an init std (`INIT_STD`) large enough that attending to the wrong keys moves log-probs visibly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from weir.tasks.tiny_model import build_tokenizer

__all__ = ["ARCHS", "INIT_STD", "WINDOW", "build_arch_model", "arch_config"]

WINDOW = 8
INIT_STD = 0.1

_DIMS = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_position_embeddings=256,
    initializer_range=INIT_STD,
    tie_word_embeddings=False,
)
_HYBRID = ["sliding_attention", "full_attention"]

# name -> (model_type, config overrides)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("llama", dict(num_hidden_layers=2, rope_theta=500000.0)),
    "qwen2": (
        "qwen2",
        dict(
            num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
    ),
    "qwen3": ("qwen3", dict(num_hidden_layers=2)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_hidden_layers=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        ),
    ),
    "mistral": ("mistral", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "phi3_window": ("phi3", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "phi3": ("phi3", dict(num_hidden_layers=2, sliding_window=None)),
    "gemma2": (
        "gemma2",
        dict(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            layer_types=_HYBRID,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=8,
        ),
    ),
    "gemma3": (
        "gemma3_text",
        dict(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            layer_types=_HYBRID,
            query_pre_attn_scalar=8,
            final_logit_softcapping=3.0,
        ),
    ),
    "olmo2": ("olmo2", dict(num_hidden_layers=2)),
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            layer_types=_HYBRID,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        ),
    ),
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            n_shared_experts=1,
        ),
    ),
}


def arch_config(name: str, **overrides: Any) -> PretrainedConfig:
    """The HF config of tiny architecture `name` (a key of `ARCHS`), with weir's vocabulary."""
    if name not in ARCHS:
        raise ValueError(f"unknown tiny architecture {name!r}; choose one of {sorted(ARCHS)}")
    model_type, extra = ARCHS[name]
    tok = build_tokenizer()
    kwargs = dict(_DIMS)
    kwargs.update(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def build_arch_model(out_dir: str | Path, name: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-init model of tiny architecture `name` and weir's tokenizer to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = arch_config(name, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
