"""Input validation shared by every public function of :mod:`weir.algo`.

Every check raises :class:`ValueError` with the argument's name, what was expected and
what was received. Checks that need a value from the device (finiteness, mask values)
are batched into a single host synchronisation per public call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "check_tensor",
    "check_float_tensor",
    "check_shape",
    "check_mask",
    "check_positive",
    "check_finite_number",
    "check_finite_where",
    "masked_mean",
    "masked_max",
    "masked_min",
    "sanitize",
]


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"[:120]


def check_tensor(name: str, x: object) -> Tensor:
    """Return ``x`` if it is a tensor, else raise ValueError naming ``name``."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {_describe(x)}")
    return x


def check_float_tensor(name: str, x: object, ndim: int | None = None) -> Tensor:
    """Tensor with a floating dtype and, when given, exactly ``ndim`` dimensions."""
    x = check_tensor(name, x)
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimension(s), got shape {tuple(x.shape)}")
    return x


def check_shape(name: str, x: Tensor, shape: Sequence[int], what: str) -> Tensor:
    """Raise unless ``x.shape == shape``; ``what`` explains the expected shape."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(x.shape)}")
    return x


def check_mask(name: str, mask: object, shape: Sequence[int] | None = None) -> Tensor:
    """Validate a 2-D 0/1 mask (bool, integer or float) and return it as a bool tensor.

    The non-empty and 0/1-value checks run here; callers decide whether a mask that
    selects nothing is an error.
    """
    mask = check_tensor(name, mask)
    if mask.dim() != 2:
        raise ValueError(
            f"{name}: expected a 2-D (batch, response_tokens) mask, got shape {tuple(mask.shape)}"
        )
    if shape is not None:
        check_shape(name, mask, shape, "(batch, response_tokens)")
    if mask.shape[0] == 0 or mask.shape[1] == 0:
        raise ValueError(f"{name}: empty batch, got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"{name}: expected a bool, integer or float 0/1 mask, got {mask.dtype}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name}: expected only 0 and 1 values (1 = trained token)")
    return mask != 0


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    """A finite python number > 0 (or >= 0)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {_describe(value)}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected a finite number {bound}, got {value!r}")
    return v


def check_finite_number(name: str, value: float) -> float:
    """A finite python number."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {_describe(value)}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return v


def check_finite_where(tensors: dict[str, Tensor | None], mask: Tensor) -> None:
    """Raise if any named tensor holds NaN/inf at a position where ``mask`` is true.

    Positions where ``mask`` is false are never inspected: they may hold anything.
    One host synchronisation for all tensors.
    """
    names = [k for k, v in tensors.items() if v is not None]
    if not names:
        return
    bad = torch.stack(
        [(~torch.isfinite(tensors[k].detach()) & mask).any() for k in names]  # type: ignore[union-attr]
    ).tolist()
    offenders = [k for k, b in zip(names, bad, strict=True) if b]
    if offenders:
        raise ValueError(
            f"{', '.join(offenders)}: expected finite values at every position where the mask "
            "is 1, found NaN or inf"
        )


def sanitize(x: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:
    """``x`` where ``mask`` is true, ``fill`` elsewhere (keeps the autograd graph for ``x``).

    Used at the entry of every function so that values at masked positions (including
    NaN/inf) can never reach an output or a gradient.
    """
    return torch.where(mask, x, torch.full((), fill, dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over ``mask``; 0 when the mask selects nothing."""
    n = mask.sum()
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    return total / n.clamp(min=1).to(total.dtype)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max of ``x`` over ``mask``; 0 when the mask selects nothing."""
    if x.numel() == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    neg = torch.full((), -torch.inf, dtype=x.dtype, device=x.device)
    m = torch.where(mask, x, neg).max()
    return torch.where(mask.any(), m, torch.zeros_like(m))


def masked_min(x: Tensor, mask: Tensor) -> Tensor:
    """Min of ``x`` over ``mask``; 0 when the mask selects nothing."""
    return -masked_max(-x, mask)
