"""Counter-based random numbers for weir's engine: each sample owns a stream keyed by its request's
seed and its index, so a seeded request samples the same tokens however it is batched. The same
function exists in Python (`mix32`) and in torch (`stream_uniform`); tests check one against the other.
"""

from __future__ import annotations

import torch

__all__ = ["mix32", "sample_key", "stream_uniform"]


_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
# Multipliers below 2**31 keep every product of a 32-bit value under 2**63 (no int64 overflow).
_C1 = 0x21F0AAAD
_C2 = 0x735A2D97


def mix32(x: int) -> int:
    """A 32-bit integer hash (a bijection on [0, 2**32)); the Python twin of `_mix32_t`."""
    x &= _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 15)


def _mix32_t(x: torch.Tensor) -> torch.Tensor:
    """`mix32` on an int64 tensor of values in [0, 2**32) (modified in place and returned)."""
    x.bitwise_xor_(x >> 16).mul_(_C1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15).mul_(_C2).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 15)


def stream_uniform(key: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The uniform in (0, 1) (float32) for token index `step` of the streams with 32-bit `key`."""
    h = _mix32_t(step.mul(_GOLDEN).add_(key).bitwise_and_(_M32))
    return h.to(torch.float32).add_(0.5).mul_(2.0**-32)


def sample_key(seed: int, sample_index: int) -> int:
    """The stream key of sample `sample_index` of a request seeded with `seed` (any Python int)."""
    s = mix32(mix32(seed & _M32) ^ mix32((seed >> 32) ^ 0x6A09E667))
    return mix32(s ^ mix32(sample_index + 0x3C6EF372))
