"""Model shapes the benchmarks build at random init: real models' `config.json` values (Qwen2.5)
and small ones for checking a code path on a CPU. One table, so every benchmark that says
"Qwen2.5-0.5B's shape" means the same numbers."""

from __future__ import annotations

from typing import Any

from weir.tasks.tiny_model import SIZES

QWEN25: dict[str, dict[str, Any]] = {
    # hidden, layers, heads, KV heads, MLP, vocabulary; tied embeddings up to 3B
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "32b": dict(
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        intermediate_size=27648,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}

SMALL: dict[str, dict[str, Any]] = {
    "tiny": {**SIZES["tiny"], "vocab_size": 512},  # weir's tiny:tiny with a 512-token vocabulary
    "40m": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1536,
        vocab_size=32000,
    ),
}


def head_dim(shape: dict[str, Any]) -> int:
    return shape["hidden_size"] // shape["num_attention_heads"]
