"""Response log-probs with one padded row per sequence: the path for models that do not keep packed
sequences apart (`train.packing: padded`, or chosen by the start-up self-check).

Rows are right-padded and the model gets a 2D attention mask, so every architecture builds its own
causal (and sliding-window) masks per row, exactly as in a plain forward of each sequence alone.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from weir.algo import entropy_from_logits, logprobs_from_logits
from weir.train.packing import PackedOutput, packed_response_logprobs

__all__ = ["padded_response_logprobs", "response_logprobs"]


def padded_response_logprobs(
    model: torch.nn.Module,
    sequences: list[list[int]],
    response_lengths: list[int],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    pad_to: int | None = None,
) -> PackedOutput:
    """Same result as `packed_response_logprobs` (logp_t = log_softmax(z_{t-1} / T)[x_t] at each
    response position), computed on a right-padded batch ``[len(sequences), longest]``."""
    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
    attn = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq, device=device)
        attn[i, : len(seq)] = 1
    positions = torch.arange(width, device=device).expand(len(sequences), -1)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False)
    rows, cols = [], []
    for i, (seq, n) in enumerate(zip(sequences, response_lengths, strict=True)):
        rows.append(torch.full((n,), i, device=device))
        cols.append(torch.arange(len(seq) - n - 1, len(seq) - 1, device=device))
    r, c = torch.cat(rows), torch.cat(cols)
    logits = out.logits[r, c].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = logprobs_from_logits(logits, ids[r, c + 1])
    ent = None
    if with_entropy:
        ent = entropy_from_logits(logits if entropy_grad else logits.detach())

    def to_rows(x: torch.Tensor) -> torch.Tensor:
        padded = pad_sequence(list(torch.split(x, response_lengths)), batch_first=True)
        if pad_to is not None and padded.shape[1] < pad_to:
            padded = torch.nn.functional.pad(padded, (0, pad_to - padded.shape[1]))
        return padded

    return PackedOutput(to_rows(logp), to_rows(ent) if ent is not None else None)


def response_logprobs(
    model: torch.nn.Module,
    sequences: list[list[int]],
    response_lengths: list[int],
    *,
    packing: str = "packed",
    **kwargs,
) -> PackedOutput:
    """`padded_response_logprobs` when `packing` is "padded", else `packed_response_logprobs`."""
    fn = padded_response_logprobs if packing == "padded" else packed_response_logprobs
    return fn(model, sequences, response_lengths, **kwargs)
