"""Packed micro-batches: sequences concatenated into one row, attention kept within each sequence.

HF models build a block-diagonal causal mask when `position_ids` restart at 0 for each sequence and
no attention mask or cache is passed, so packing wastes no compute on padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from weir.algo import entropy_from_logits, logprobs_from_logits


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


@dataclass
class PackedOutput:
    """Per-token results for the response part of each packed sequence, padded to (b, T)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


def packed_response_logprobs(
    model: torch.nn.Module,
    sequences: list[list[int]],
    response_lengths: list[int],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    pad_to: int | None = None,
) -> PackedOutput:
    """Log-probs (and entropy) of the last `response_lengths[i]` tokens of each sequence.

    logp_t = log_softmax(z_{t-1} / T)[x_t], computed only at response positions (the LM head runs
    on those positions alone through `logits_to_keep`).
    """
    device = next(model.parameters()).device
    flat, positions, keep, offset = [], [], [], 0
    for seq, n in zip(sequences, response_lengths, strict=True):
        flat.extend(seq)
        positions.append(torch.arange(len(seq)))
        keep.append(torch.arange(offset + len(seq) - n - 1, offset + len(seq) - 1))
        offset += len(seq)
    input_ids = torch.tensor([flat], device=device)
    position_ids = torch.cat(positions)[None].to(device)
    keep_idx = torch.cat(keep).to(device)
    out = model(
        input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep_idx
    )
    logits = out.logits[0].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = logprobs_from_logits(logits, input_ids[0, keep_idx + 1])
    ent = None
    if with_entropy:
        ent = entropy_from_logits(logits if entropy_grad else logits.detach())

    def to_rows(x: torch.Tensor) -> torch.Tensor:
        rows = pad_sequence(list(torch.split(x, response_lengths)), batch_first=True)
        if pad_to is not None and rows.shape[1] < pad_to:
            rows = torch.nn.functional.pad(rows, (0, pad_to - rows.shape[1]))
        return rows

    return PackedOutput(to_rows(logp), to_rows(ent) if ent is not None else None)
