"""Per-token log-probs and entropy of logits [N, V] in two hand-written Triton kernels.

`token_logprobs_and_entropy(..., kernel="triton")` runs these instead of its chunk functions: one
launch for the forward of all N rows, one for the backward, each logit read once per launch (the
forward reads 2 bytes per bf16 logit, the backward 2 and writes 2; the compiled chunks read each
logit several times). The values are those of `_stats_chunk` / `_grad_chunk` in `entropy.py`,
non-finite logits included, up to float32 rounding (another summation order, and the GPU's
approximate exp and log).

Forward, per row, with ``z = x (1 / T)`` in float32 (the float32 reciprocal, as torch's CUDA
division by a scalar takes it), streaming over blocks of ``BLOCK_V`` columns
(online softmax): the running shift ``c`` (the row maximum so far; 0 while it is +-inf, as
`torch.logsumexp` takes it), ``s = sum_v exp(z_v - c)`` and ``t = sum_v exp(z_v - c) (z_v - c)``
(terms with ``exp = 0`` count 0: an -inf logit would give 0 * -inf), both rescaled by
``exp(c_old - c_new)`` when the maximum grows (``t`` also gains ``(c_old - c_new) s``). Then

    log s,    logp = z[id] - (c + log s),    H = -sum_v p_v log p_v = log s - t / s.

Backward, pointwise (a 2-D grid of rows x column blocks), with ``log p = z - c - log s``:

    d/dz_v = -p_v (g + g_H (log p_v + H)) / T   (0 where p_v = 0),   plus g / T at the token id.

Offsets are 64-bit (row * V passes 2^31 at 14k x 151,936), rows may be strided (a row slice of a
larger tensor); columns must be contiguous. Triton is imported on first use (it costs ~0.4 s), and
the kernels are jitted then: Triton reads TRITON_INTERPRET (run the kernels on CPU tensors in its
interpreter: how CI tests them) when a kernel is decorated, so each setting gets its own build.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "triton_status",
    "c_compiler",
    "interpreting",
    "stats",
    "grad",
    "DTYPES",
    "FWD_BLOCK_V",
    "BWD_BLOCK_V",
]

FWD_BLOCK_V = 8192  # columns per step of the forward's row loop (a power of two)
BWD_BLOCK_V = 4096  # columns per program of the backward
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

tl: Any = None  # triton.language, bound by `_kernels` (the kernels below resolve it at launch)


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter (kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def c_compiler() -> str | None:
    """The C compiler Triton builds its launchers with ($CC, else cc, gcc or clang on PATH), or
    None: `triton_status` and `entropy.compile_status` both need one."""
    names = (os.environ.get("CC") or "cc", "gcc", "clang")
    return next((path for name in names if (path := shutil.which(name))), None)


def triton_status(device: torch.device | str) -> str:
    """``"available"`` where the Triton kernels run on tensors of `device`: TRITON_INTERPRET=1 (the
    interpreter, any device), or CUDA with Triton and a C compiler (Triton builds its launchers
    with one); else why not, in one line."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if interpreting():
        return "available"
    if torch.device(device).type != "cuda":
        return "not CUDA (set TRITON_INTERPRET=1 to run the Triton kernels in its interpreter)"
    if c_compiler() is None:
        return "no C compiler (cc, gcc or clang; Triton needs one)"
    return "available"


def _forward_kernel(
    X,
    stride_x,
    IDS,
    M,
    LOG_S,
    LOGP,
    H,
    inv_t,
    V: tl.constexpr,
    WITH_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per row: m, log s, logp and (WITH_H) H from one read of the row. V is a
    constant of the build (one per vocabulary): the loop's trip count is then known, and
    Triton's interpreter cannot take a run-time loop bound under NumPy >= 2.4."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")  # the row's running maximum
    c = 0.0  # the shift: m, or 0 while m is +-inf
    s = 0.0  # sum exp(z - c)
    t = 0.0  # sum exp(z - c) (z - c)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = tl.load(x_row + offs, mask=offs < V, other=-float("inf"), eviction_policy="evict_first")
        z = x.to(tl.float32) * inv_t
        m = tl.maximum(m, tl.max(z, axis=0))
        c_new = tl.where(tl.abs(m) == float("inf"), 0.0, m)
        # rescale to the new shift; s == 0: nothing so far (all -inf), and 0 * exp(big) is NaN
        keep = (c_new == c) | (s == 0.0)
        alpha = tl.exp(c - c_new)
        if WITH_H:
            t = tl.where(keep, t, alpha * (t + (c - c_new) * s))
        s = tl.where(keep, s, alpha * s)
        c = c_new
        zc = z - c
        e = tl.exp(zc)
        s += tl.sum(e, axis=0)
        if WITH_H:
            t += tl.sum(tl.where(e == 0.0, 0.0, e * zc), axis=0)
    log_s = tl.log(s)
    z_id = tl.load(x_row + tl.load(IDS + row)).to(tl.float32) * inv_t
    tl.store(M + row, tl.where(s != s, s, c))  # NaN with NaN logits, as torch.amax gives it
    tl.store(LOG_S + row, log_s)
    tl.store(LOGP + row, z_id - (log_s + c))
    if WITH_H:
        tl.store(H + row, log_s - t / s)


def _backward_kernel(
    X,
    stride_x,
    OUT,
    stride_out,
    IDS,
    M,
    LOG_S,
    H,
    G,
    G_H,
    V,
    inv_t,
    WITH_GH: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ROUND_BY_HAND: tl.constexpr,
):
    """One program per (row, block of BLOCK_V columns): the gradient of that block. With
    ROUND_BY_HAND (bfloat16 in Triton's interpreter, whose float32 -> bfloat16 cast truncates) the
    float32 gradient is rounded to the nearest bfloat16 (ties to even) on its bits first, as the
    GPU's conversion rounds; on the GPU it is off (integer work the conversion does itself)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    lp = (x.to(tl.float32) * inv_t - tl.load(M + row)) - tl.load(LOG_S + row)
    g_row = tl.load(G + row) * inv_t
    p = tl.exp(lp)
    if WITH_GH:
        u = (lp + tl.load(H + row)) * (tl.load(G_H + row) * inv_t) + g_row
        g = tl.where(p == 0.0, 0.0, -(p * u))
    else:
        g = p * -g_row
    g = tl.where(cols == tl.load(IDS + row), g + g_row, g)
    if ROUND_BY_HAND:
        b = g.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        g = tl.where(g != g, g, b.to(tl.float32, bitcast=True))
    tl.store(OUT + row * stride_out + cols, g.to(OUT.dtype.element_ty), mask=mask)


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """The two kernels jitted (for the interpreter when `interpret`); imports Triton."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_forward_kernel), triton.jit(_backward_kernel)


def _rows(x: Tensor) -> Tensor:
    """`x` [N, V] with contiguous columns (a row slice stays a view)."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _on(x: Tensor) -> contextlib.AbstractContextManager[Any]:
    """`x`'s CUDA device as the current one (Triton launches on the current device)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _block(v: int, block_v: int) -> int:
    """`block_v` columns, or fewer for a small vocabulary: V's next power of two (at least 16)."""
    return min(block_v, max(16, 1 << (v - 1).bit_length()))


def _reciprocal(temperature: float) -> float:
    """1 / T as torch's CUDA division of float32 logits by T takes it: float32(1 / float32(T))
    (Python's 1.0 / T, rounded to float32 at the launch, is one rounding off for some T)."""
    return torch.tensor(temperature, dtype=torch.float32).reciprocal().item()


def _warps(block: int) -> int:
    """16 columns per thread (8192: 16 warps, 4096: 8)."""
    return max(1, min(16, block // 512))


def stats(
    logits: Tensor,
    ids: Tensor,
    temperature: float,
    entropy: bool,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Per row of `logits` [N, V] (float32 / bfloat16 / float16): m, log s, the log-prob of
    `ids` [N] and, with `entropy`, H (None without); float32 [N]. `block_v`: columns per step of
    the row loop, a power of two (default `FWD_BLOCK_V`; tests take small ones); `num_warps`:
    default `_warps(block)` (the benchmark sweeps both)."""
    x = _rows(logits)
    n, v = x.shape
    block = _block(v, block_v or FWD_BLOCK_V)
    out = [torch.empty(n, dtype=torch.float32, device=x.device) for _ in range(4 if entropy else 3)]
    if n:
        fwd, _ = _kernels(interpreting())
        h = out[3] if entropy else out[2]  # not written without the entropy
        with _on(x):
            fwd[(n,)](
                x,
                x.stride(0),
                ids.contiguous(),
                out[0],
                out[1],
                out[2],
                h,
                _reciprocal(temperature),
                V=v,
                WITH_H=entropy,
                BLOCK_V=block,
                num_warps=num_warps or _warps(block),
            )
    return out[0], out[1], out[2], out[3] if entropy else None


def grad(
    logits: Tensor,
    ids: Tensor,
    m: Tensor,
    log_s: Tensor,
    h: Tensor | None,
    g_logp: Tensor,
    g_h: Tensor | None,
    temperature: float,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """The gradient of ``sum(g_logp * logp + g_h * H)`` with respect to `logits` [N, V], in the
    logits' dtype, from the forward's m, log s and H (`stats`); without `g_h` (or `h`) the
    log-probs' term alone. `block_v`: columns per program (default `BWD_BLOCK_V`); `num_warps`:
    default `_warps(block)`."""
    x = _rows(logits)
    n, v = x.shape
    out = torch.empty(n, v, dtype=x.dtype, device=x.device)
    if n:
        _, bwd = _kernels(interpreting())
        with_gh = g_h is not None and h is not None
        g = g_logp.to(torch.float32).contiguous()
        gh = g_h.to(torch.float32).contiguous() if with_gh else g
        block = _block(v, block_v or BWD_BLOCK_V)
        grid = (n, (v + block - 1) // block)
        with _on(x):
            bwd[grid](
                x,
                x.stride(0),
                out,
                out.stride(0),
                ids.contiguous(),
                m,
                log_s,
                h if with_gh else m,
                g,
                gh,
                v,
                _reciprocal(temperature),
                WITH_GH=with_gh,
                BLOCK_V=block,
                ROUND_BY_HAND=interpreting() and x.dtype == torch.bfloat16,
                num_warps=num_warps or _warps(block),
            )
    return out
