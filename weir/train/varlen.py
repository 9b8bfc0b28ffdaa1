"""The `varlen` layout's attention: a micro-batch packed into one row, each sequence attending only
to itself, without a mask and without padding.

On CUDA in bf16/fp16 the attention is torch's own FlashAttention-2
(`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10: no flash-attn wheel, differentiable);
elsewhere (a CPU, float32, a torch without it) the same call runs
`scaled_dot_product_attention` once per sequence, so the layout computes the same numbers on every
device and is tested on a CPU.

How it reaches the model: transformers looks its attention function up by name at every call
(`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`). `install` registers, under the name
`sdpa` (`AttentionInterface.register`), a function that runs the varlen kernel for the calls weir
marks (`weir_varlen=True`, with `cu_seq_lens_q/k` and `max_length_q/k`, the FlashAttention kwargs
transformers passes from the model's forward down to its attention layers) and hands every other
call, unchanged, to transformers' own sdpa. The model's config is not touched: an engine built on
the same module, a copy of it, the padded and prefix layouts and a checkpointed layer's recompute
(which runs in the backward and reads the config then) all see plain sdpa, and a varlen forward
carries everything the kernel needs in its own arguments. Its mask argument is a (1, 1, 1, 1)
placeholder: transformers returns a 4-D mask as it is, so it never builds the (T, T) block-diagonal
mask that a packed row of position ids would make it build for sdpa (1 GiB at T = 32k).

Checked on transformers 5.17 and 5.24: the kwargs reach the attention function, the placeholder
reaches it unchanged (tests/train/test_varlen.py runs on whichever is installed).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

MARK = "weir_varlen"
"""The keyword a varlen forward passes: calls without it go to transformers' sdpa unchanged."""


@functools.cache
def _kernel() -> tuple[Callable[..., torch.Tensor], frozenset[str]] | None:
    """torch's varlen FlashAttention-2 and the names of its parameters (None before torch 2.10).

    2.10 takes `is_causal`; 2.11 `scale` and `window_size` (causal is `(-1, 0)`); 2.12 adds
    `enable_gqa`. Each is used only where the signature has it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


@functools.cache
def _ampere_or_later(index: int | None) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(index) >= (8, 0)


def flash_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the FlashAttention-2 kernel serves a forward on `device` in `dtype` (else the
    per-sequence SDPA body does): CUDA, sm80 or later, 16-bit, head dim at most 256."""
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim <= 256
        and _kernel() is not None
        and _ampere_or_later(device.index)
    )


def kernel_name(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """What a varlen forward runs on `device` in `dtype`, for the start-up log line."""
    if flash_runs(device, dtype, head_dim):
        return "torch FlashAttention-2 (varlen_attn)"
    return "SDPA per sequence"


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    kernel = _kernel()
    assert kernel is not None
    varlen_attn, params = kernel
    hq, hk, d, dv = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
    kw: dict[str, Any] = {}
    if hq != hk:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # query head h reads kv head h // (hq / hk), as transformers' repeat_kv lays it out
            k = k.repeat_interleave(hq // hk, dim=1)
            v = v.repeat_interleave(hq // hk, dim=1)
    if dv != d:  # e.g. MLA's value heads, narrower than query/key heads: zero columns, cut after
        v = F.pad(v, (0, d - dv))
    if "window_size" in params:
        kw["window_size"] = (window - 1 if window else -1, 0)
    else:
        kw["is_causal"] = True
    if "scale" in params:
        kw["scale"] = scale
    else:  # the kernel's own scale is 1 / sqrt(d)
        q = q * (scale * math.sqrt(d))
    out = varlen_attn(
        q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, **kw
    )
    return out[..., :dv]


def _per_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Causal (windowed) attention of each sequence ``cu[i]:cu[i+1]`` alone, by SDPA."""
    bounds = cu.tolist()
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for s, e in zip(bounds, bounds[1:], strict=False):
        # (1, H, L, D): SDPA's fused kernels take 4-D inputs only (3-D falls back to the math
        # kernel, which keeps every L x L attention matrix for the backward)
        qs, ks, vs = (x[s:e].transpose(0, 1)[None] for x in (q, k, v))
        n, mask = e - s, None
        if window is not None and window < n:
            i = torch.arange(n, device=q.device)
            mask = (i[:, None] >= i[None]) & (i[:, None] - i[None] < window)
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor,
    max_length_q: int,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a packed row ``(1, H, T, D)``: causal within each sequence of `cu_seq_lens_q`
    (a key at most `sliding_window - 1` positions back, transformers' window rule, where the layer
    has one). Returns ``(1, T, H, Dv)`` as transformers' attention functions do."""
    if dropout:
        raise ValueError(
            "the varlen layout runs without attention dropout (the trainer's eval mode)"
        )
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"the varlen layout cannot run attention with {unsupported}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
    kind = q.device.type
    if torch.is_autocast_enabled(kind):
        # as autocast casts SDPA's inputs: RoPE with the residual stream's float32 cos/sin
        # leaves q and k in float32 beside a bf16 v, and the kernel is no autocast op
        dtype = torch.get_autocast_dtype(kind)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = int(sliding_window) if sliding_window else None
    if flash_runs(q.device, q.dtype, q.shape[-1]) and (
        window is None or "window_size" in _kernel()[1]  # type: ignore[index]
    ):
        out = _flash(q, k, v, cu_seq_lens_q, int(max_length_q), scale, window)
    else:
        out = _per_sequence(q, k, v, cu_seq_lens_q, scale, window)
    return out.unsqueeze(0), None


def install() -> None:
    """Register the routing `sdpa` function with transformers (once per process)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(current, MARK, False):
        return

    @functools.wraps(current)
    def sdpa_or_varlen(module, query, key, value, attention_mask, *args, **kwargs):
        if kwargs.pop(MARK, False):
            return varlen_attention(module, query, key, value, **kwargs)
        return current(module, query, key, value, attention_mask, *args, **kwargs)

    setattr(sdpa_or_varlen, MARK, True)
    AttentionInterface.register("sdpa", sdpa_or_varlen)


def varlen_inputs(lengths: list[int], device: torch.device) -> dict[str, Any]:
    """The forward kwargs of a packed row of sequences of `lengths`: cumulative offsets (int32, one
    host-to-device copy), the longest length as a host int (no device sync), the mark, and the
    placeholder mask."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    if device.type == "cuda":
        cu = cu.pin_memory().to(device, non_blocking=True)
    longest = max(lengths)
    return {
        "attention_mask": torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        MARK: True,
    }


def varlen_refusal(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run the varlen layout exactly (None: it can). It needs its attention
    looked up as transformers' `sdpa` (the route above) and nothing the kernel cannot compute."""
    from weir.data.vision_model import vision_model

    if vision_model(model) is not None:
        return "a vision-language model (its vision tower shares the attention setting)"
    cfg = getattr(model, "config", None)
    attn = getattr(cfg, "_attn_implementation", None) or "eager"
    if attn != "sdpa":
        return f"attention {attn!r} (the varlen route is taken from sdpa)"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "attention soft-capping (the varlen kernel has none)"
    if getattr(cfg, "attention_chunk_size", None):
        return "chunked attention"
    if any(hasattr(m, "sinks") for m in model.modules()):
        return "attention sinks (the varlen kernel has none)"
    return None
