"""Model FLOPs of one trainer step of a Qwen2-shaped decoder, three ways (benchmarks/gpu_trainer.py
says which and why): model FLOPs, 6ND and verl's `_estimate_qwen2_flops`."""

from __future__ import annotations

from typing import Any


def dims(shape: dict[str, Any]) -> dict[str, int]:
    d = shape["hidden_size"]
    heads = shape["num_attention_heads"]
    return {
        "d": d,
        "layers": shape["num_hidden_layers"],
        "heads": heads,
        "kv_heads": shape["num_key_value_heads"],
        "head_dim": shape.get("head_dim") or d // heads,
        "ffn": shape["intermediate_size"],
        "vocab": shape["vocab_size"],
    }


def layer_params(shape: dict[str, Any]) -> int:
    """Parameters of one Qwen2 decoder layer: q, k, v (with biases), o, gate, up, down, 2 norms."""
    k = dims(shape)
    q, kv = k["heads"] * k["head_dim"], k["kv_heads"] * k["head_dim"]
    attn = k["d"] * (q + 2 * kv) + (q + 2 * kv) + q * k["d"]
    return attn + 3 * k["d"] * k["ffn"] + 2 * k["d"]


def step_flops(
    shape: dict[str, Any], seq_lens: list[int], resp_lens: list[int], params: int
) -> dict[str, float]:
    """FLOPs of one forward + backward over sequences of `seq_lens` (prompt + response) whose
    last `resp_lens` tokens are responses, by the three formulas of the module docstring;
    `params`: every parameter of the model (a tied embedding counted once)."""
    k = dims(shape)
    tokens = sum(seq_lens)
    responses = sum(resp_lens)
    non_embedding = k["layers"] * layer_params(shape) + k["d"]  # + the final norm
    pairs = sum(s * (s + 1) // 2 for s in seq_lens)
    attention = 12 * pairs * k["head_dim"] * k["heads"] * k["layers"]
    model = 6 * non_embedding * tokens + 6 * k["vocab"] * k["d"] * responses + attention
    q, kv = k["heads"] * k["head_dim"], k["kv_heads"] * k["head_dim"]
    verl_n = k["layers"] * (3 * k["d"] * k["ffn"] + k["d"] * (2 * q + 2 * kv))
    verl_n += 2 * k["vocab"] * k["d"]
    verl = (
        6 * verl_n * tokens
        + 12 * sum(s * s for s in seq_lens) * k["head_dim"] * k["heads"] * k["layers"]
    )
    return {"model": float(model), "6nd": float(6 * params * tokens), "verl": float(verl)}
