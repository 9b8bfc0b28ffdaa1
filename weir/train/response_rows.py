"""What every micro-batch layout of the trainer's forward returns, and the pieces they share:
per-token log-probs and entropy at response positions, left-padded input rows, ragged results
as padded rows."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from weir.algo import entropy_from_logits, logprobs_from_logits
from weir.algo.entropy import KERNELS as FUSED_KERNELS
from weir.algo.entropy import compile_status, token_logprobs_and_entropy
from weir.algo.logprob_triton import triton_status

KERNELS = (*FUSED_KERNELS, "reference")
_kernel: ContextVar[str] = ContextVar("weir_logprob_kernel", default="auto")


def check_kernel(name: str, device: torch.device) -> None:
    """Refuse `train.logprob_kernel=compiled` (or `triton`) up front where it cannot compile
    (or launch its Triton kernels): one line, why."""
    if name not in ("compiled", "triton"):
        return
    status = compile_status(device) if name == "compiled" else triton_status(device)
    if status != "available":
        raise ValueError(
            f"train.logprob_kernel={name} on {device}: {status}; use train.logprob_kernel=auto"
        )


@contextlib.contextmanager
def logprob_kernel(name: str) -> Iterator[None]:
    """`token_stats` within the block computes with kernel `name` (`train.logprob_kernel`):
    `auto`, `compiled`, `eager` or `triton` (`weir.algo.token_logprobs_and_entropy`), or
    `reference` (the two separate functions, `logprobs_from_logits` and `entropy_from_logits`). The
    actor sets it around its forwards, so the layouts need not pass it down."""
    if name not in KERNELS:
        raise ValueError(f"train.logprob_kernel: unknown kernel {name!r}; choose one of {KERNELS}")
    token = _kernel.set(name)
    try:
        yield
    finally:
        _kernel.reset(token)


@dataclass
class PackedOutput:
    """Per-token results for the response part of each sequence, padded to (b, T)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` under `logits / T` and, if asked, the entropy (with its gradient only
    if `entropy_grad`: never a graph for a metric), in chunks of `chunk_size` rows, from one pass
    over the logits (`weir.algo.token_logprobs_and_entropy`, with the kernel `logprob_kernel`
    chose); T <= 0 counts as 1. Nothing here reads the device (no host synchronisation)."""
    t = temperature if temperature > 0 else 1.0
    kernel = _kernel.get()
    if kernel != "reference":
        mode = ("grad" if entropy_grad else "value") if with_entropy else "none"
        return token_logprobs_and_entropy(
            logits, targets, chunk_size, temperature=t, entropy=mode, kernel=kernel
        )
    logp = logprobs_from_logits(logits, targets, chunk_size, temperature=t, allow_nonfinite=True)
    ent = None
    if with_entropy:
        src = logits if entropy_grad else logits.detach()
        ent = entropy_from_logits(src, chunk_size, temperature=t, allow_nonfinite=True)
    return logp, ent


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t`, built on the host, on `device` without waiting: on CUDA from pinned memory with a
    non-blocking copy (a copy from pageable memory waits for the work queued before it, which
    would stall the host once per micro-batch). torch's pinned-memory cache keeps the source
    until the copy is done."""
    if t.device == device:
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def left_pad(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences right-aligned in rows of the longest one's width: (ids, attention mask, position
    ids), on the CPU; padding is id 0, mask 0, position 0."""
    b, width = len(sequences), max(len(s) for s in sequences)
    ids = torch.zeros(b, width, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        attn[i, width - len(seq) :] = 1
    return ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)


def response_rows(x: torch.Tensor, lengths: list[int], pad_to: int | None) -> torch.Tensor:
    """The concatenated per-token values `x` split into rows of `lengths`, right-padded with zeros
    to the longest (or to `pad_to`)."""
    rows = pad_sequence(list(torch.split(x, lengths)), batch_first=True)
    if pad_to is not None and rows.shape[1] < pad_to:
        rows = torch.nn.functional.pad(rows, (0, pad_to - rows.shape[1]))
    return rows
