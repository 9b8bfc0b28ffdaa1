"""The engine's attention masks per layer type: causal + padding, and a sliding window where a layer
has one, in the form the HF model takes them (one tensor, or a dict by layer type).

In the engine's KV cache every row is right-aligned and its tokens sit in consecutive columns, so the
distance between two columns of a row is the distance between their positions. HF's sliding window
lets query position q see key position k when ``q - window < k <= q``; on columns, a query in column
``i`` keeps key column ``j`` when ``i - j < window``. The caller's boolean mask already holds the
causal and padding rules; the window is a further AND. Every layer keeps the KV of all columns
(sliding layers too), so one cache geometry serves all layers; see docs/models.md for the memory this
costs.
"""

from __future__ import annotations

import torch

from weir.engine.support import ModelSupport

__all__ = ["additive", "layer_masks"]


def _windowed(mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """`mask` [rows, 1, q, kv] with key columns at or beyond `window` behind each query removed.

    The q queries are the last q of the kv columns (prefill: q == kv; decode: q == 1)."""
    if window is None:
        return mask
    q, kv = mask.shape[-2], mask.shape[-1]
    if kv <= window:  # no key is `window` columns behind any query (no device sync to find out)
        return mask
    kcol = torch.arange(kv, device=mask.device)
    qcol = kcol[kv - q :]
    return mask & ((qcol[:, None] - kcol[None, :]) < window)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attended, the dtype's lowest value elsewhere (eager attention adds the mask)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, torch.finfo(dtype).min
    )


def layer_masks(
    mask: torch.Tensor, support: ModelSupport, additive_dtype: torch.dtype | None = None
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask(s) to pass to the model for the boolean causal+padding `mask`.

    With `additive_dtype` (eager attention) the masks are additive floats of that dtype."""
    out: dict[str, torch.Tensor] = {}
    by_window: dict[int | None, torch.Tensor] = {}
    for key, window in support.windows.items():
        if window not in by_window:
            m = _windowed(mask, window)
            by_window[window] = additive(m, additive_dtype) if additive_dtype else m
        out[key] = by_window[window]
    return out if support.per_layer_type else out[""]
