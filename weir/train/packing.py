"""Micro-batch layouts for the trainer's forward, and response log-probs / entropy from them.

Two exact layouts of the same sequences:

- `packed`: a micro-batch's sequences concatenated into one row; `position_ids` restart at 0 for
  each sequence. With FlashAttention-2, HF turns those position ids into a variable-length kernel
  call (no mask, no padding). With SDPA or eager attention HF builds an L x L block-diagonal mask
  for the row, whose cost grows with the square of the packed length.
- `padded`: one left-padded row per sequence, micro-batches of similar lengths (sorted by length,
  the budget counting padded tokens), so SDPA runs per sequence with almost no padding.

`auto` takes `packed` where the attention backend has a variable-length kernel, else `padded`.

A vision-language model gets each sequence's pixel inputs (`visions`) and its multimodal rotary
positions from `weir.data.vision_model`, the same inputs the engine's prefill builds.

Log-probs and entropy are taken only at response positions (the LM head runs on those through
`logits_to_keep`) and computed in chunks by weir.algo: no full-vocabulary float32 copy of the
logits, nor a `logits / T` copy, is ever made.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn.utils.rnn import pad_sequence

from weir.algo import entropy_from_logits, logprobs_from_logits
from weir.data.vision import VisionInputs
from weir.data.vision_model import vision_model

log = logging.getLogger(__name__)

Layout = Literal["packed", "padded"]
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


def pack_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Split sequence indices into micro-batches of at most `budget` tokens (first-fit decreasing).

    A sequence longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def bucket_by_length(lengths: list[int], budget: int) -> list[list[int]]:
    """Split sequence indices into padded micro-batches of at most `budget` tokens *with* padding.

    Sequences are taken longest first; a micro-batch of rows padded to its longest holds
    `rows * longest <= budget` tokens, so similar lengths share a micro-batch and little is padding.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for i in order:
        if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= budget:
            bins[-1].append(i)
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


def micro_batches(lengths: list[int], budget: int, layout: Layout) -> list[list[int]]:
    """The micro-batches of `layout` for sequences of `lengths` under a token `budget`."""
    return (
        pack_by_tokens(lengths, budget) if layout == "packed" else bucket_by_length(lengths, budget)
    )


def choose_layout(model: torch.nn.Module, packing: str) -> Layout:
    """Resolve `train.packing` for `model`: `auto` packs only with a variable-length attention kernel."""
    if packing in ("packed", "padded"):
        return packing  # type: ignore[return-value]
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    layout: Layout = "packed" if attn in VARLEN_ATTENTION else "padded"
    log.info(
        "train.packing=auto: %s micro-batches (attention %s %s a variable-length kernel)",
        layout,
        attn,
        "has" if layout == "packed" else "has no",
    )
    return layout


@dataclass
class PackedOutput:
    """Per-token results for the response part of each sequence, padded to (b, T)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


def response_logprobs(
    model: torch.nn.Module,
    sequences: list[list[int]],
    response_lengths: list[int],
    *,
    layout: Layout = "packed",
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    pad_to: int | None = None,
    chunk_size: int = 256,
    visions: list[VisionInputs | None] | None = None,
) -> PackedOutput:
    """Log-probs (and entropy) of the last `response_lengths[i]` tokens of each sequence.

    logp_t = log_softmax(z_{t-1} / T)[x_t], computed only at response positions; both layouts give
    the same numbers (up to the summation order of the attention kernels).
    """
    fn = packed_response_logprobs if layout == "packed" else padded_response_logprobs
    return fn(
        model,
        sequences,
        response_lengths,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        pad_to=pad_to,
        chunk_size=chunk_size,
        visions=visions,
    )


def _token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    t = temperature if temperature > 0 else 1.0
    logp = logprobs_from_logits(logits, targets, chunk_size, temperature=t, allow_nonfinite=True)
    ent = None
    if with_entropy:
        src = logits if entropy_grad else logits.detach()
        ent = entropy_from_logits(src, chunk_size, temperature=t, allow_nonfinite=True)
    return logp, ent


def _rows(x: torch.Tensor, lengths: list[int], pad_to: int | None) -> torch.Tensor:
    rows = pad_sequence(list(torch.split(x, lengths)), batch_first=True)
    if pad_to is not None and rows.shape[1] < pad_to:
        rows = torch.nn.functional.pad(rows, (0, pad_to - rows.shape[1]))
    return rows


def packed_response_logprobs(
    model: torch.nn.Module,
    sequences: list[list[int]],
    response_lengths: list[int],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    pad_to: int | None = None,
    chunk_size: int = 256,
    visions: list[VisionInputs | None] | None = None,
) -> PackedOutput:
    """The `packed` layout: one row, position ids restarting per sequence (see the module docstring)."""
    device = next(model.parameters()).device
    flat, positions, keep, offset = [], [], [], 0
    for seq, n in zip(sequences, response_lengths, strict=True):
        flat.extend(seq)
        positions.extend(range(len(seq)))
        keep.extend(range(offset + len(seq) - n - 1, offset + len(seq) - 1))
        offset += len(seq)
    input_ids = torch.tensor([flat], device=device)
    extra = {"position_ids": torch.tensor([positions], device=device)}
    vm = vision_model(model)
    if vm is not None:  # even without images: the 1-D text positions keep the sequences apart
        extra = vm.packed_inputs(sequences, visions or [None] * len(sequences))
    keep_idx = torch.tensor(keep, device=device)
    out = model(input_ids=input_ids, use_cache=False, logits_to_keep=keep_idx, **extra)
    logp, ent = _token_stats(
        out.logits[0],
        input_ids[0, keep_idx + 1],
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        chunk_size=chunk_size,
    )
    return PackedOutput(
        _rows(logp, response_lengths, pad_to),
        _rows(ent, response_lengths, pad_to) if ent is not None else None,
    )


def padded_response_logprobs(
    model: torch.nn.Module,
    sequences: list[list[int]],
    response_lengths: list[int],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    pad_to: int | None = None,
    chunk_size: int = 256,
    visions: list[VisionInputs | None] | None = None,
) -> PackedOutput:
    """The `padded` layout: one left-padded row per sequence.

    Left padding lines every response up against the row's end, so the LM head runs on the last
    R + 1 positions only (R the longest response). The chunked log-prob runs over that whole
    (b, R + 1) block as a view (no gather copy of the logits); the columns that belong to no
    response get a dummy target and are dropped afterwards.
    """
    device = next(model.parameters()).device
    b, width = len(sequences), max(len(s) for s in sequences)
    r = max(response_lengths)
    ids = torch.zeros(b, width, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        attn[i, width - len(seq) :] = 1
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    ids, attn = ids.to(device), attn.to(device)
    extra = {"position_ids": positions.to(device)}
    if visions is not None and any(v is not None for v in visions):
        vm = vision_model(model)
        if vm is None:
            raise ValueError("sequences with images for a text-only model")
        extra, _ = vm.padded_inputs(sequences, visions, width)
    out = model(
        input_ids=ids,
        attention_mask=attn,
        use_cache=False,
        logits_to_keep=r + 1,
        **extra,
    )
    logits = out.logits  # (b, r + 1, V): positions width - r - 1 ... width - 1
    targets = torch.cat([ids[:, width - r :], torch.zeros_like(ids[:, :1])], dim=1)
    logp, ent = _token_stats(
        logits.reshape(b * (r + 1), -1),
        targets.reshape(-1),
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        chunk_size=chunk_size,
    )
    lengths = torch.tensor(response_lengths, device=device)
    col = torch.arange(r, device=device)
    # row i's response is predicted by columns r - n_i ... r - 1; move it to columns 0 ... n_i - 1
    src = (r - lengths[:, None] + col[None]).clamp(max=r - 1)
    valid = col[None] < lengths[:, None]

    def left_align(x: torch.Tensor) -> torch.Tensor:
        rows = torch.where(valid, x.view(b, r + 1).gather(1, src), 0.0)
        if pad_to is not None and rows.shape[1] < pad_to:
            rows = torch.nn.functional.pad(rows, (0, pad_to - rows.shape[1]))
        return rows

    return PackedOutput(left_align(logp), left_align(ent) if ent is not None else None)
