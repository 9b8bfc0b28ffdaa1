"""Loss aggregation: per-token loss [B, T] -> scalar, split-invariant.

Every mode divides by *global* counts of the whole optimizer batch (all micro-batches,
all data-parallel ranks), passed in by the caller, never by counts of the tensor at
hand. A batch split by rows into any number of micro-batches therefore gives the same
total loss, and the same gradient, when the micro-batch losses are summed (gradient
accumulation without rescaling; with DDP/FSDP averaging over ``W`` ranks, multiply the
loss by ``W`` or pass counts divided by ``W``).

Rows are sequences: ``seq-*`` modes treat each row of the mask as one sample. A
micro-batch whose mask selects nothing contributes exactly 0 (still connected to the
graph, so ``backward`` works and gives zero gradients).
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from ._checks import (
    check_finite_where,
    check_float_tensor,
    check_mask,
    check_positive,
    sanitize,
)
from .registry import suggest

__all__ = ["AGG_MODES", "AggMode", "aggregate_loss"]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
AggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]


def check_agg(mode: str, max_len: int | None) -> None:
    """Validate an aggregation mode and its ``max_len``."""
    if mode not in AGG_MODES:
        raise ValueError(
            f"agg: unknown aggregation mode {mode!r}; valid: {', '.join(AGG_MODES)}"
            f"{suggest(str(mode), AGG_MODES)}"
        )
    if mode == "seq-mean-token-sum-norm":
        if max_len is None:
            raise ValueError(
                "max_len: 'seq-mean-token-sum-norm' needs max_len= (a constant such as the "
                "generation limit, the same for every micro-batch)"
            )
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len <= 0:
            raise ValueError(f"max_len: expected a positive int, got {max_len!r}")


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: AggMode,
    *,
    num_tokens: float,
    num_seqs: float,
    max_len: int | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar with global normalisers.

    With ``l`` the per-token loss, ``m`` the mask, ``n_b = sum_t m[b, t]``, ``N`` =
    ``num_tokens`` and ``S`` = ``num_seqs`` (global counts of the optimizer batch):

    * ``token-mean``: ``sum_{b,t} m l / N`` (DAPO's token-level loss, Yu et al. 2025).
    * ``seq-mean-token-sum``: ``sum_b (sum_t m l) / S``.
    * ``seq-mean-token-mean``: ``sum_b (sum_t m l / n_b) / S`` (GRPO's original
      per-sequence mean, Shao et al. 2024; rows with ``n_b = 0`` add 0).
    * ``seq-mean-token-sum-norm``: ``sum_b (sum_t m l) / (S * max_len)`` (Dr.GRPO,
      Liu et al. 2025: a constant length normaliser instead of ``n_b``).

    Args:
        per_token_loss: [B, T] float.
        mask: [B, T] 0/1.
        mode: one of :data:`AGG_MODES`.
        num_tokens: trained tokens in the whole optimizer batch (> 0).
        num_seqs: sequences in the whole optimizer batch (> 0).
        max_len: constant length normaliser, required by ``seq-mean-token-sum-norm``.

    Raises:
        ValueError: unknown mode, missing/invalid ``max_len``, non-positive counts, shape
            mismatch, or NaN/inf loss at a trained position (masked positions are never
            read).
    """
    check_agg(mode, max_len)
    per_token_loss = check_float_tensor("per_token_loss", per_token_loss, ndim=2)
    m = check_mask("mask", mask, per_token_loss.shape)
    n_tok = check_positive("num_tokens", num_tokens)
    n_seq = check_positive("num_seqs", num_seqs)
    check_finite_where({"per_token_loss": per_token_loss}, m)
    return _aggregate(per_token_loss, m, mode, n_tok, n_seq, max_len)


def _aggregate(
    loss: Tensor, m: Tensor, mode: str, n_tok: float, n_seq: float, max_len: int | None
) -> Tensor:
    """:func:`aggregate_loss` without validation (``m`` bool, counts > 0)."""
    masked = sanitize(loss, m)
    if mode == "token-mean":
        return masked.sum() / n_tok
    if mode == "seq-mean-token-sum":
        return masked.sum() / n_seq
    if mode == "seq-mean-token-mean":
        n_b = m.sum(dim=1).clamp(min=1).to(loss.dtype)
        return (masked.sum(dim=1) / n_b).sum() / n_seq
    assert max_len is not None
    return masked.sum() / (n_seq * float(max_len))
