"""Entropy and token log-probabilities from logits, chunked over tokens.

Both functions take logits [..., V], process ``chunk_size`` rows at a time in float32
(float64 stays float64) and never hold more than one chunk of vocab-sized temporaries:
no full ``log_softmax`` / ``softmax`` copy of the logits is built, neither in the forward
nor in the backward pass. The backward pass recomputes each chunk from the saved logits
(a reference, not a copy) and the saved per-row logsumexp / entropy. Gradients are
returned in the logits' dtype. Double backward is not supported.

``temperature`` divides the logits inside each chunk, so ``logits / T`` is never
materialised either.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._checks import check_float_tensor, check_positive, check_shape, check_tensor

__all__ = ["entropy_from_logits", "logprobs_from_logits", "DEFAULT_CHUNK_SIZE"]

DEFAULT_CHUNK_SIZE = 512


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _chunk(logits: Tensor, s: int, e: int, temperature: float, dtype: torch.dtype) -> Tensor:
    x = logits[s:e].to(dtype)
    return x / temperature if temperature != 1.0 else x


def _plogp(p: Tensor, logp: Tensor) -> Tensor:
    return torch.where(p == 0, torch.zeros((), dtype=p.dtype, device=p.device), p * logp)


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, chunk_size: int, temperature: float) -> Tensor:
        dtype = _compute_dtype(logits)
        n = logits.shape[0]
        out = torch.empty(n, dtype=dtype, device=logits.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logp = torch.log_softmax(_chunk(logits, s, e, temperature, dtype), dim=-1)
            out[s:e] = -_plogp(logp.exp(), logp).sum(dim=-1)
        ctx.save_for_backward(logits, out)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, H = ctx.saved_tensors
        dtype = H.dtype
        grad = torch.empty_like(logits)
        n = logits.shape[0]
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            logp = torch.log_softmax(_chunk(logits, s, e, ctx.temperature, dtype), dim=-1)
            p = logp.exp()
            g = -(_plogp(p, logp) + p * H[s:e, None]) * (grad_out[s:e, None] / ctx.temperature)
            grad[s:e] = g.to(grad.dtype)
        return grad, None, None


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, ids: Tensor, chunk_size: int, temperature: float
    ) -> Tensor:
        dtype = _compute_dtype(logits)
        n = logits.shape[0]
        out = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            x = _chunk(logits, s, e, temperature, dtype)
            lse[s:e] = torch.logsumexp(x, dim=-1)
            out[s:e] = x.gather(1, ids[s:e, None]).squeeze(1) - lse[s:e]
        ctx.save_for_backward(logits, ids, lse)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None]:
        logits, ids, lse = ctx.saved_tensors
        dtype = lse.dtype
        grad = torch.empty_like(logits)
        n = logits.shape[0]
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            x = _chunk(logits, s, e, ctx.temperature, dtype)
            g_row = grad_out[s:e, None] / ctx.temperature
            g = -torch.exp(x - lse[s:e, None]) * g_row
            g.scatter_add_(1, ids[s:e, None], g_row)
            grad[s:e] = g.to(grad.dtype)
        return grad, None, None, None


def _check_chunk(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    return chunk_size


def entropy_from_logits(
    logits: Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    temperature: float = 1.0,
    allow_nonfinite: bool = False,
) -> Tensor:
    """Entropy of the categorical distribution ``softmax(logits / temperature)`` per row.

    ``H = -sum_v p_v log p_v`` with ``log p = log_softmax(x)`` (logsumexp-based); terms
    with ``p_v = 0`` (e.g. ``-inf`` logits) count as 0. Differentiable (gradient
    ``dH/dx_v = -p_v (log p_v + H)``), chunked over the rows (see the module docstring).

    Args:
        logits: [..., V] float logits.
        chunk_size: rows per chunk (default 512).
        temperature: sampling temperature (> 0).
        allow_nonfinite: return non-finite values instead of raising (see
            :func:`logprobs_from_logits`).

    Returns:
        [...] float32 (float64 for float64 logits).

    Raises:
        ValueError: not a float tensor, no vocab dimension, empty vocab, bad
            ``chunk_size`` / ``temperature``, or a row whose entropy is not finite
            (NaN logits, or a row that is all ``-inf``).
    """
    logits = check_float_tensor("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits: expected shape [..., V] with V > 0, got {tuple(logits.shape)}")
    _check_chunk(chunk_size)
    temperature = check_positive("temperature", temperature)
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    out = _Entropy.apply(flat, chunk_size, temperature)
    if not allow_nonfinite and out.numel() and not bool(torch.isfinite(out.detach()).all()):
        raise ValueError("logits: some rows give a non-finite entropy (NaN logits or all -inf)")
    return out.reshape(lead)


def logprobs_from_logits(
    logits: Tensor,
    token_ids: Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    temperature: float = 1.0,
    allow_nonfinite: bool = False,
) -> Tensor:
    """Log-probability of ``token_ids`` under ``softmax(logits / temperature)``.

    ``logp_i = x_{i, y_i} - logsumexp_v x_{i, v}`` with ``x = logits / temperature``.
    Differentiable (gradient ``onehot(y) - softmax(x)``, divided by the temperature),
    chunked over rows (see the module docstring). The usual call passes logits [N, V]
    shifted so that row ``i`` predicts ``token_ids[i]``; any leading shape works.

    Args:
        logits: [N, V] (or [..., V]) float logits.
        token_ids: [N] (or [...]) integer ids in ``[0, V)``.
        chunk_size: rows per chunk (default 512).
        temperature: sampling temperature (> 0); use the engine's to match its log-probs.
        allow_nonfinite: return non-finite values instead of raising; the trainer contains them
            itself (it leaves the sample out, or skips the update, and counts it).

    Returns:
        [N] (or [...]) float32 log-probs (float64 for float64 logits).

    Raises:
        ValueError: shape mismatch, non-integer or out-of-range ids, empty vocab, bad
            ``chunk_size`` / ``temperature``, or a non-finite result (NaN logits, or an
            id whose logit is ``-inf``).
    """
    logits = check_float_tensor("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits: expected shape [..., V] with V > 0, got {tuple(logits.shape)}")
    token_ids = check_tensor("token_ids", token_ids)
    if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids: expected an integer tensor, got dtype {token_ids.dtype}")
    check_shape("token_ids", token_ids, logits.shape[:-1], "logits.shape[:-1]")
    _check_chunk(chunk_size)
    temperature = check_positive("temperature", temperature)
    V = logits.shape[-1]
    ids = token_ids.reshape(-1).long()
    if ids.numel() and bool(((ids < 0) | (ids >= V)).any()):
        raise ValueError(f"token_ids: expected ids in [0, {V}) (the vocab size of logits)")
    flat = logits.reshape(-1, V)
    out = _TokenLogprobs.apply(flat, ids, chunk_size, temperature)
    if not allow_nonfinite and out.numel() and not bool(torch.isfinite(out.detach()).all()):
        raise ValueError(
            "logits: some rows give a non-finite log-prob (NaN logits, or -inf at the token id)"
        )
    return out.reshape(token_ids.shape)
