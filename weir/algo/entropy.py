"""Entropy and token log-probabilities from logits, chunked over tokens.

Every function takes logits [..., V], processes ``chunk_size`` rows at a time in float32
(float64 stays float64) and never holds more than one chunk of vocab-sized temporaries:
no full ``log_softmax`` / ``softmax`` copy of the logits is built, neither in the forward
nor in the backward pass. The backward pass recomputes each chunk from the saved logits
(a reference, not a copy) and the saved per-row logsumexp / entropy. Gradients are
returned in the logits' dtype. Double backward is not supported.

``temperature`` divides the logits inside each chunk, so ``logits / T`` is never
materialised either.

`logprobs_from_logits` and `entropy_from_logits` are the reference: one statistic each, their
inputs checked (one host synchronisation per call). `token_logprobs_and_entropy` is what the
trainer runs: both statistics from one pass over each chunk and one gradient (the two
statistics' terms summed in float32 before the single cast to the logits' dtype), no check
that reads the device. Its chunk functions are plain tensor code; on CUDA, where Triton and a
C compiler are there, they run `torch.compile`d (`kernel="auto"`), which fuses each chunk's
upcast, reductions and gradient into a few kernels that read the bfloat16 logits instead of
materialising float32 temporaries (about 10 bytes per logit element against about 144).
``kernel="triton"`` runs two hand-written Triton kernels instead (`weir.algo.logprob_triton`): one
launch over all the rows for the forward, one for the backward, each logit read once.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import logprob_triton
from ._checks import check_float_tensor, check_positive, check_shape, check_tensor

__all__ = [
    "entropy_from_logits",
    "logprobs_from_logits",
    "token_logprobs_and_entropy",
    "compile_status",
    "DEFAULT_CHUNK_SIZE",
]

log = logging.getLogger(__name__)

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


def _check_token_args(
    logits: Tensor, token_ids: Tensor, chunk_size: int, temperature: float
) -> tuple[Tensor, Tensor, float]:
    """The checks `logprobs_from_logits` and `token_logprobs_and_entropy` share: float logits
    [..., V] with V > 0, integer ids shaped as the logits' leading dims, a valid chunk size and a
    positive temperature; returns the checked logits, ids and temperature."""
    logits = check_float_tensor("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits: expected shape [..., V] with V > 0, got {tuple(logits.shape)}")
    token_ids = check_tensor("token_ids", token_ids)
    if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids: expected an integer tensor, got dtype {token_ids.dtype}")
    check_shape("token_ids", token_ids, logits.shape[:-1], "logits.shape[:-1]")
    _check_chunk(chunk_size)
    return logits, token_ids, check_positive("temperature", temperature)


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
    logits, token_ids, temperature = _check_token_args(logits, token_ids, chunk_size, temperature)
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


# -- the trainer's fused pass ----------------------------------------------------------------------

EntropyMode = Literal["none", "value", "grad"]
Kernel = Literal["auto", "compiled", "eager", "triton"]
KERNELS = ("auto", "compiled", "eager", "triton")


def _stats_chunk(x: Tensor, ids: Tensor, temperature: float, entropy: bool) -> tuple[Tensor, ...]:
    """One chunk's forward, from one read of its logits: per row the maximum m of ``z = x / T``
    (0 where it is infinite, as `torch.logsumexp` takes it), ``log s = log sum_v exp(z_v - m)``,
    the log-prob ``z[id] - (m + log s)`` and, with `entropy`, ``H = -sum_v p_v log p_v`` with
    ``log p = (z - m) - log s`` (``p log p = 0`` where ``p = 0``); float32 (float64 for float64
    logits). The same operations as `torch.logsumexp` and `torch.log_softmax`, so the values are
    those of the reference functions; in place where it can, so that eagerly two chunk-sized
    temporaries exist at a time."""
    z = x.to(_compute_dtype(x), copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(m.abs() == float("inf"), 0.0, m)
    target = z.gather(1, ids[:, None])
    zm = z.sub_(m)
    e = zm.exp()
    log_s = e.sum(-1, keepdim=True).log_()
    logp = target - (log_s + m)
    if not entropy:
        return m[:, 0], log_s[:, 0], logp[:, 0]
    lp = zm.sub_(log_s)
    p = torch.exp(lp, out=e)
    zero = p == 0
    plogp = p.mul_(lp).masked_fill_(zero, 0.0)
    return m[:, 0], log_s[:, 0], logp[:, 0], plogp.sum(-1).neg_()


def _grad_chunk(
    x: Tensor,
    ids: Tensor,
    m: Tensor,
    log_s: Tensor,
    h: Tensor | None,
    g_logp: Tensor,
    g_h: Tensor | None,
    temperature: float,
    out: Tensor,
    scatter: bool = True,
) -> None:
    """One chunk's gradient into `out` (the logits' dtype), recomputed from the chunk and the
    forward's m and log s (`_stats_chunk`):

        d logp / dz_v = (onehot(id)_v - p_v) / T     d H / dz_v = -p_v (log p_v + H) / T

    each times its upstream gradient (g, g_H), summed in float32:
    ``-p (g + g_H (log p + H)) / T`` (0 where p = 0), plus ``g / T`` at the token id, added by
    `scatter` (eager: in place) or by a comparison with the column index (one fused kernel when
    compiled)."""
    z = x.to(m.dtype, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    lp = z.sub_(m[:, None]).sub_(log_s[:, None])
    g_row = (g_logp / temperature)[:, None]
    p = lp.exp()
    if g_h is not None and h is not None:
        zero = p == 0
        t = lp.add_(h[:, None]).mul_((g_h / temperature)[:, None]).add_(g_row)
        g = p.mul_(t).neg_().masked_fill_(zero, 0.0)
    else:
        g = p.mul_(-g_row)
    if scatter:
        g.scatter_add_(1, ids[:, None], g_row)
    else:
        hit = torch.arange(g.shape[1], device=g.device)[None] == ids[:, None]
        g = torch.where(hit, g + g_row, g)
    out.copy_(g)


_compiled: dict[str, Callable[..., Any]] = {}
_compile_failure: list[str] = []  # why the compiled kernels failed once in this process
_COMPILE_OPTIONS: dict[str, Any] = {"dynamic": True}  # torch.compile's (tests swap the backend)


def compile_status(device: torch.device | str) -> str:
    """``"available"`` when `token_logprobs_and_entropy` compiles its chunk functions for tensors
    on `device` (kernel="auto"), else why not: not CUDA (compiling on a CPU costs minutes), no
    `torch.compile`, no Triton, no C compiler (Triton builds its launchers with one), or an
    earlier compile in this process failed."""
    if torch.device(device).type != "cuda":
        return "not CUDA: eager chunks"
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if logprob_triton.c_compiler() is None:
        return "no C compiler (cc, gcc or clang; Triton needs one)"
    if _compile_failure:
        return f"compiling failed in this process: {_compile_failure[0]}"
    return "available"


def _call(fn: Callable[..., Any], compiled: bool, *args: Any) -> Any:
    """`fn(*args)`, `torch.compile`d when `compiled`; a compiler failure (not an out-of-memory)
    is logged once and the eager function runs from then on.

    One graph per function and branch (entropy or not, its gradient or not), whatever the row
    counts, the layout the logits came from and the caller's modes: the row count is dynamic, and
    what the compiled function would otherwise guard on is kept out of its view. A chunk of one
    row runs eagerly (dynamo specialises a size of 1); tensors are passed detached (a view makes
    it guard on its base's shape, which differs between a packed row and padded rows, and on
    `requires_grad`; the detached alias shares the memory, so `out` is still written in place);
    autocast is off inside (it is a guarded global state, and the chunk computes in float32 by
    itself)."""
    if not compiled or _compile_failure or args[0].shape[0] < 2:
        return fn(*args)
    cfn = _compiled.get(fn.__name__)
    if cfn is None:
        cfn = _compiled[fn.__name__] = torch.compile(fn, **_COMPILE_OPTIONS)
    args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
    try:
        with torch.autocast(args[0].device.type, enabled=False):
            return cfn(*args)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - any compiler error: the eager code computes the same
        _compile_failure.append(f"{type(err).__name__}: {str(err)[:200]}")
        log.warning(
            "the compiled log-prob kernel failed (%s); using the eager chunks from now on",
            _compile_failure[0],
        )
        return fn(*args)


_triton_failure: list[str] = []  # why the Triton kernels failed once in this process


def _triton(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` (a Triton launch: `logprob_triton`), or None once they failed in this process:
    a compile or launch failure (not an out-of-memory) is logged once, and the chunks run from
    then on. In the interpreter (tests) it is raised: a bug must not hide behind the chunks."""
    if _triton_failure:
        return None
    try:
        return fn(*args)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - any Triton error: the chunks compute the same
        if logprob_triton.interpreting():
            raise
        _triton_failure.append(f"{type(err).__name__}: {str(err)[:200]}")
        log.warning(
            "the Triton log-prob kernels failed (%s); using the chunked kernels from now on",
            _triton_failure[0],
        )
        return None


def _chunked_stats(
    logits: Tensor, ids: Tensor, chunk_size: int, temperature: float, entropy: bool, compiled: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """m, log s, the log-probs and (with `entropy`) H of every row, `_stats_chunk` by chunks."""
    n = logits.shape[0]
    dtype = _compute_dtype(logits)
    m, log_s, logp = (torch.empty(n, dtype=dtype, device=logits.device) for _ in range(3))
    h = torch.empty(n, dtype=dtype, device=logits.device) if entropy else None
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        part = _call(_stats_chunk, compiled, logits[s:e], ids[s:e], temperature, entropy)
        m[s:e], log_s[s:e], logp[s:e] = part[0], part[1], part[2]
        if h is not None:
            h[s:e] = part[3]
    return m, log_s, logp, h


def _chunked_grad(args: tuple[Any, ...], chunk_size: int, compiled: bool) -> Tensor:
    """The gradient of all rows, `_grad_chunk` by chunks, from `args` = (logits, ids, m, log s,
    H, g_logp, g_H, T) (H's term only with g_H)."""
    logits, ids, m, log_s, h, g_logp, g_h, temperature = args
    grad = torch.empty_like(logits)
    for s in range(0, logits.shape[0], chunk_size):
        e = min(s + chunk_size, logits.shape[0])
        hs, g_hs = (None, None) if g_h is None or h is None else (h[s:e], g_h[s:e])
        rows = (logits[s:e], ids[s:e], m[s:e], log_s[s:e], hs, g_logp[s:e], g_hs)
        _call(_grad_chunk, compiled, *rows, temperature, grad[s:e], not compiled)
    return grad


class _FusedStats(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        ids: Tensor,
        chunk_size: int,
        temperature: float,
        entropy: EntropyMode,
        compiled: bool,
        triton: bool,
    ) -> tuple[Tensor, Tensor]:
        with_h = entropy != "none"
        out = _triton(logprob_triton.stats, logits, ids, temperature, with_h) if triton else None
        ctx.triton = out is not None
        if out is None:
            out = _chunked_stats(logits, ids, chunk_size, temperature, with_h, compiled)
        m, log_s, logp, h = out
        if h is None:
            h = torch.empty(0, dtype=logp.dtype, device=logits.device)
        ctx.save_for_backward(logits, ids, m, log_s, h if entropy == "grad" else None)
        ctx.chunk_size, ctx.temperature, ctx.compiled = chunk_size, temperature, compiled
        ctx.set_materialize_grads(False)
        if entropy != "grad":
            ctx.mark_non_differentiable(h)
        return logp, h

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_logp: Tensor | None, g_h: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, ids, m, log_s, h = ctx.saved_tensors
        if h is None:
            g_h = None
        if g_logp is None and g_h is None:
            return (None,) * 7
        if g_logp is None:
            g_logp = torch.zeros_like(m)
        args = (logits, ids, m, log_s, h, g_logp, g_h, ctx.temperature)
        grad = _triton(logprob_triton.grad, *args) if ctx.triton else None
        if grad is None:
            grad = _chunked_grad(args, ctx.chunk_size, ctx.compiled)
        return (grad,) + (None,) * 6


def token_logprobs_and_entropy(
    logits: Tensor,
    token_ids: Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    temperature: float = 1.0,
    entropy: EntropyMode = "value",
    kernel: Kernel = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of `token_ids` and the entropy under ``softmax(logits / temperature)``, from one
    pass over each chunk of rows: `logprobs_from_logits` and `entropy_from_logits` in one.

    ``logp_i = z_{i, y_i} - logsumexp_v z_{i, v}`` and ``H_i = -sum_v p_{i,v} log p_{i,v}`` with
    ``z = logits / T``. The backward recomputes each chunk from the logits and returns one
    gradient, ``(g_logp (onehot(y) - p) - g_H p (log p + H)) / T``, summed in float32 before the
    cast to the logits' dtype.

    Args:
        logits: [N, V] (or [..., V]) float logits; bfloat16 logits are read as they are.
        token_ids: [N] (or [...]) integer ids in ``[0, V)``. Not checked on the device (that would
            cost a host synchronisation): an id out of range is an indexing error there.
        chunk_size: rows per chunk.
        temperature: the sampling temperature T (> 0).
        entropy: ``"grad"``: the entropy with its gradient (an entropy bonus trains on it);
            ``"value"``: computed in the same pass without a gradient (a metric); ``"none"``: not
            computed (returns None).
        kernel: ``"eager"`` runs the chunk functions as they are; ``"compiled"`` runs them through
            `torch.compile` (CUDA with Triton and a C compiler: `compile_status`); ``"auto"``
            compiles where `compile_status` says it can. A compiler error falls back to eager.
            ``"triton"``: the two Triton kernels of `weir.algo.logprob_triton` over all rows at
            once, no chunks (`chunk_size` unused; where `triton_status` says so: CUDA with a C
            compiler, or TRITON_INTERPRET=1); float64 logits, and every call after a Triton
            compile or launch failure (logged once), run the chunks as ``"auto"`` would.

    Returns:
        (log-probs, entropy or None), shaped as `token_ids`, float32 (float64 for float64 logits).
        Non-finite values are returned as they are (NaN logits, an id whose logit is -inf).
    """
    logits, token_ids, temperature = _check_token_args(logits, token_ids, chunk_size, temperature)
    if entropy not in ("none", "value", "grad"):
        raise ValueError(f"entropy: expected 'none', 'value' or 'grad', got {entropy!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    status = compile_status(logits.device)
    if kernel == "compiled" and status != "available":
        raise ValueError(f"kernel='compiled': {status}; use kernel='auto' or 'eager'")
    if kernel == "triton" and (why := logprob_triton.triton_status(logits.device)) != "available":
        raise ValueError(f"kernel='triton': {why}; use kernel='auto' or 'eager'")
    compiled = kernel != "eager" and status == "available"
    triton = kernel == "triton" and logits.dtype in logprob_triton.DTYPES
    flat = logits.reshape(-1, logits.shape[-1])
    ids = token_ids.reshape(-1).long()
    logp, h = _FusedStats.apply(flat, ids, chunk_size, temperature, entropy, compiled, triton)
    shape = token_ids.shape
    return logp.reshape(shape), None if entropy == "none" else h.reshape(shape)
