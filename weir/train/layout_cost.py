"""What a step's micro-batches cost in each exact layout, and the cheapest one for its lengths.

Every layout runs the same sequences to the same numbers; they differ in the work around it. Costs
are counted from the micro-batches each layout would actually build (`weir.train.packing`), in
units of one token through the decoder stack (forward and backward, ``6 N_dec`` FLOPs):

    cost = tokens + head_row * head_rows + attn_pair * pairs * (masked ? masked_attn : 1)
           + pass_tokens * forwards + seq_tokens * per-sequence attention calls

(times `UNCOMPILED_STEP` for `prefix` where the decoder layers are compiled: its forwards carry a
KV cache, and the compiled layers run those uncompiled)

- `tokens`: positions the decoder runs, padding included (`padded` pads each micro-batch to its
  longest sequence; `prefix` runs each prompt once, then the responses padded to the longest of
  their pass; `varlen` runs exactly the tokens);
- `head_rows`: rows through the LM head and the vocabulary-wide log-softmax: ``b (r + 1)`` for a
  padded micro-batch of longest response r, ``b R`` for a one-pass prefix one, ``sum R`` for
  varlen. A row costs ``V d (1 + s) / N_dec`` tokens (``s``: the log-softmax and entropy passes
  over the row, element-wise work priced against the matmul);
- `pairs`: causal (query, key) pairs of attention, ``2 H_q d_h layers / N_dec`` tokens each, dearer
  by `masked_attn` where a padding mask takes SDPA off its flash kernel;
- `forwards`: model forwards (prefix: two per micro-batch, or one per response bucket on a CPU);
  each costs a fixed `pass_tokens` (kernel launches, Python);
- per-sequence calls: varlen on the per-sequence SDPA body (a CPU, float32) calls attention once
  per sequence and layer.

Memory is bounded alike: each layout's micro-batches hold at most `train.micro_batch_tokens`
computed tokens, padding included, so activations and logits per micro-batch stay within the same
budget (prefix's gathered prompt KV adds ``b P 2 layers H_kv d_h`` values, under 1% of the
activations for grouped-query models).

The GPU prices (`SOFTMAX_FACTOR`, `masked_attn` 2.0, `GPU_PASS_TOKENS`) against the one GPU
measurement there is (benchmarks/gpu_trainer.py on an H200, 2026-11-27, docs/gpu.md: the
Qwen2.5-0.5B shape, 128 samples with lognormal responses, 58,688 tokens in micro-batches of 16,384):
the model puts padded at 1.32x varlen and the one-pass prefix at 1.98x; measured, padded took
0.936 s against 0.702-0.711 s for varlen (1.32-1.33x), and `auto` ran varlen. The 1.5B figures of
that run are left out (every model there ran partly on Liger's kernels, which the run's earlier
`train.fuse=liger` part had patched in process-wide: 1.28x measured, 1.17x modelled), and prefix was
not measured (the run took `auto`'s first candidate for the layout it ran); the benchmark now
writes the modelled prices beside each measured layout. `SOFTMAX_FACTOR` between 1 (the compiled
fused head's passes cost about its matmul) and 4 moves the 0.5B ratio by 0.03, within the run's
noise, and changes no choice on the batches of tests/train/test_layout_cost.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from weir.train.packing import Layout, bucket_by_length, pack_by_tokens, prefix_micro_batches
from weir.train.prefix_pass import RESPONSE_PASS_TOKENS, response_buckets

log = logging.getLogger(__name__)

SOFTMAX_FACTOR = 4.0
"""``s`` above: the vocabulary-wide log-prob and entropy passes of a head row against its matmul.
Bandwidth-bound on a GPU (about 144 bytes per logit unfused, docs/trainer-step.md)."""
GPU_PASS_TOKENS = 1024
"""One more forward and backward on a GPU, in tokens: its kernel launches (not measured apart; see
the module docstring for what the GPU prices were checked against)."""
UNCOMPILED_STEP = 1.35
"""A step's cost with the decoder layers uncompiled against `train.fuse=compile`'s compiled ones:
what `prefix` pays there, its forwards carrying a KV cache, which the compiled layers run
uncompiled (`weir.train.fuse`). The smaller of the two gains measured on an H200 (2026-11-27,
compute copy, docs/trainer-step.md): 0.636 s -> 0.450 s a step at the Qwen2.5-0.5B shape (1.41x),
1.536-1.564 s -> 1.128-1.150 s at 1.5B (1.34-1.39x)."""
SEQUENCE_CALL_TOKENS = 14
"""varlen's per-sequence SDPA body (a CPU, float32): one sequence's attention call in one layer,
forward and backward, in tokens. Measured on weir's tiny model on a CPU (benchmarks/layouts.py:
varlen 1.8 s over padded for 64 sequences x 4 layers at 0.48 ms a token); a larger model's token
costs more, so this overprices the calls there, which only keeps `auto` off the slow body."""


@dataclass(frozen=True)
class CostModel:
    """Prices, in tokens through the decoder stack, of the other parts of a step."""

    head_row: float
    attn_pair: float
    masked_attn: float = 1.5
    pass_tokens: float = RESPONSE_PASS_TOKENS
    seq_tokens: float = 0.0
    prefix_factor: float = 1.0
    """The whole of prefix's cost times this: `UNCOMPILED_STEP` where the layers are compiled."""

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, device: torch.device, varlen_flash: bool
    ) -> CostModel:
        """The prices for `model` on `device`; `varlen_flash`: varlen runs the FlashAttention
        kernel (else one SDPA call per sequence and layer)."""
        cfg = model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        heads = int(cfg.num_attention_heads)
        head = model.get_output_embeddings().weight
        ends = {id(p) for p in (head, model.get_input_embeddings().weight)}
        return cls.for_shape(
            vocab=int(head.shape[0]),
            hidden=int(cfg.hidden_size),
            heads=heads,
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            layers=int(cfg.num_hidden_layers),
            decoder_params=sum(p.numel() for p in model.parameters() if id(p) not in ends),
            gpu=device.type == "cuda",
            varlen_flash=varlen_flash,
        )

    @classmethod
    def for_shape(
        cls,
        *,
        vocab: int,
        hidden: int,
        heads: int,
        head_dim: int,
        layers: int,
        decoder_params: int,
        gpu: bool,
        varlen_flash: bool,
    ) -> CostModel:
        """The prices of a model of these dimensions (`decoder_params`: every parameter but the
        embedding and LM head)."""
        n_dec = max(decoder_params, 1)
        return cls(
            head_row=vocab * hidden * (1 + SOFTMAX_FACTOR) / n_dec,
            attn_pair=2 * heads * head_dim * layers / n_dec,
            masked_attn=2.0 if gpu else 1.5,
            pass_tokens=GPU_PASS_TOKENS if gpu else RESPONSE_PASS_TOKENS,
            seq_tokens=0.0 if varlen_flash else SEQUENCE_CALL_TOKENS * layers,
        )


@dataclass(frozen=True)
class LayoutCost:
    """One layout's work on a step's sequences."""

    tokens: int
    head_rows: int
    pairs: float
    masked_pairs: float
    forwards: int
    sequence_calls: int
    total: float


def _pairs(n: int) -> float:
    return n * (n + 1) / 2


def layout_cost(
    layout: Layout,
    sequences: list[list[int]],
    response_lengths: list[int],
    budget: int,
    prices: CostModel,
    *,
    one_pass: bool = False,
) -> LayoutCost:
    """The work of `layout` on `sequences` in micro-batches of `budget` tokens (see the module
    docstring). `one_pass`: prefix runs each micro-batch's responses in one pass (FSDP ranks, and
    any CUDA device, as `weir.train.prefix_pass` does); else in the buckets of `response_buckets`."""
    lengths = [len(s) for s in sequences]
    tokens = head = forwards = calls = 0
    pairs = masked = 0.0
    if layout in ("varlen", "packed"):
        for mb in pack_by_tokens(lengths, budget):
            tokens += sum(lengths[i] for i in mb)
            head += sum(response_lengths[i] for i in mb)
            pairs += sum(_pairs(lengths[i]) for i in mb)
            forwards += 1
            calls += len(mb) if layout == "varlen" else 0
    elif layout == "padded":
        for mb in bucket_by_length(lengths, budget):
            width = max(lengths[i] for i in mb)
            tokens += len(mb) * width
            head += len(mb) * (max(response_lengths[i] for i in mb) + 1)
            p = len(mb) * _pairs(width)
            if any(lengths[i] != width for i in mb):
                masked += p
            else:
                pairs += p
            forwards += 1
    elif layout == "prefix":
        for mb in prefix_micro_batches(sequences, response_lengths, budget):
            prompts = {tuple(sequences[i][: lengths[i] - response_lengths[i]]) for i in mb}
            p_width = max(len(p) for p in prompts)
            tokens += len(prompts) * p_width
            p = len(prompts) * _pairs(p_width)
            if len({len(q) for q in prompts}) > 1:
                masked += p
            else:
                pairs += p
            forwards += 1
            head += len(mb)  # the prompt pass's last logits, one row per response
            runs = sorted((response_lengths[i] for i in mb), reverse=True)
            # the response passes as `prefix_response_logprobs` runs them
            for lo, hi in [(0, len(runs))] if one_pass else response_buckets(runs):
                width = max(runs[lo] - 1, 1 if one_pass else 0)
                if width == 0:  # one-token responses: no pass
                    continue
                tokens += (hi - lo) * width
                head += (hi - lo) * width
                masked += (hi - lo) * (width * p_width + _pairs(width))
                forwards += 1
    else:
        raise ValueError(f"unknown layout {layout!r}")
    total = (
        tokens
        + prices.head_row * head
        + prices.attn_pair * (pairs + prices.masked_attn * masked)
        + prices.pass_tokens * forwards
        + prices.seq_tokens * calls
    ) * (prices.prefix_factor if layout == "prefix" else 1.0)
    return LayoutCost(tokens, head, pairs, masked, forwards, calls, total)


def cheapest_layout(
    candidates: list[Layout],
    sequences: list[list[int]],
    response_lengths: list[int],
    budget: int,
    prices: CostModel,
    *,
    one_pass: bool = False,
) -> tuple[Layout, dict[str, float]]:
    """The candidate of least `layout_cost` (ties: the earlier candidate), and every candidate's
    total relative to the cheapest one's."""
    if len(candidates) == 1:
        return candidates[0], {candidates[0]: 1.0}
    totals = {
        c: layout_cost(c, sequences, response_lengths, budget, prices, one_pass=one_pass).total
        for c in candidates
    }
    best = min(candidates, key=lambda c: totals[c])
    low = max(totals[best], 1e-9)
    return best, {c: totals[c] / low for c in candidates}


class LayoutChoice:
    """The exact layouts a trainer may run (`weir.train.packing.exact_layouts`) and the one it
    runs now: `pick` takes the cheapest for a step's sequences and logs each change of choice."""

    def __init__(self, candidates: list[Layout], prices: CostModel, *, one_pass: bool) -> None:
        self.candidates = list(candidates)
        self.prices = prices
        self.one_pass = one_pass
        self.current: Layout = self.candidates[0]
        self._logged: Layout | None = None if len(self.candidates) > 1 else self.current

    def pick(self, sequences: list[list[int]], response_lengths: list[int], budget: int) -> Layout:
        """Run the cheapest candidate for these sequences (every rank computes the same choice
        from the same batch)."""
        if len(self.candidates) == 1 or not sequences:
            return self.current
        self.current, relative = cheapest_layout(
            self.candidates,
            sequences,
            response_lengths,
            budget,
            self.prices,
            one_pass=self.one_pass,
        )
        if self.current != self._logged:
            others = ", ".join(f"{c} {r:.2f}x" for c, r in relative.items() if c != self.current)
            log.info(
                "train.packing=auto: %s micro-batches from this step (modelled cost of the others: "
                "%s)",
                self.current,
                others,
            )
            self._logged = self.current
        return self.current


def layout_choice(
    model: torch.nn.Module,
    candidates: list[Layout],
    device: torch.device,
    compute_dtype: torch.dtype,
    one_pass: bool,
    compiled: bool = False,
) -> LayoutChoice:
    """The `LayoutChoice` of a trainer of `model` on `device` computing in `compute_dtype`:
    priced by whether varlen runs the FlashAttention kernel there, with `prefix` in one pass
    where the trainer runs it so (`one_pass`: FSDP ranks) or off a CPU (`weir.train.prefix_pass`),
    and `prefix` dearer by `UNCOMPILED_STEP` where the layers are `compiled` (`train.fuse`)."""
    from weir.train.varlen import flash_runs

    head_dim = getattr(model.config, "head_dim", None) or 64
    flash = flash_runs(device, compute_dtype, head_dim)
    prices = CostModel.for_model(model, device, varlen_flash=flash)
    if compiled:
        prices = replace(prices, prefix_factor=UNCOMPILED_STEP)
    return LayoutChoice(candidates, prices, one_pass=one_pass or device.type != "cpu")
