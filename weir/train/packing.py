"""Micro-batch layouts for the trainer's forward, and response log-probs / entropy from them.

Two exact layouts of the same sequences:

- `packed`: a micro-batch's sequences concatenated into one row; `position_ids` restart at 0 for
  each sequence. With FlashAttention-2, HF turns those position ids into a variable-length kernel
  call (no mask, no padding). With SDPA or eager attention HF builds an L x L block-diagonal mask
  for the row, whose cost grows with the square of the packed length.
- `padded`: one left-padded row per sequence, micro-batches of similar lengths (sorted by length,
  the budget counting padded tokens), so SDPA runs per sequence with almost no padding.

- `varlen`: the `packed` row without a mask: each sequence attends only to itself through a
  variable-length attention kernel (`weir.train.varlen`: torch's FlashAttention-2 on a GPU, SDPA
  per sequence elsewhere), fed cumulative sequence offsets. No padding, no (L, L) mask, and the LM
  head runs on the response positions only.
- `prefix`: the sequences that share a prompt (the `n` samples of a GRPO group) run it once. A
  prompt pass over the distinct prompts (left-padded) builds their KV cache, the cache rows are
  gathered to one per sequence, and a response pass runs the responses (right-padded) on top of it.
  The gather's backward adds up every response's gradient into its prompt, so gradients are those
  of the per-sequence forward. For n responses of R tokens to a P-token prompt, the layers process
  P + n * R tokens instead of n * (P + R); the last response token, whose logits predict nothing
  that is trained, is not run at all.

The `prefix` pass itself is `weir.train.prefix_pass`; what every layout shares (the output, the
per-token statistics, padded rows) is `weir.train.response_rows`.

`choose_layout` resolves `train.packing` to one layout; `exact_layouts` lists the layouts that run a
model exactly, among which the RL actor picks the cheapest for each step's lengths
(`weir.train.layout_cost`).

A vision-language model gets each sequence's pixel inputs (`visions`) and its multimodal rotary
positions from `weir.data.vision_model`, the same inputs the engine's prefill builds.

Log-probs and entropy are taken only at response positions (the LM head runs on those through
`logits_to_keep`) and computed in chunks by weir.algo: no full-vocabulary float32 copy of the
logits, nor a `logits / T` copy, is ever made.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from weir.config.devices import rounding_tolerance
from weir.data.moe_routing import Routes, replaying
from weir.data.vision import VisionInputs
from weir.data.vision_model import vision_model
from weir.hf_compat import is_checkpointing
from weir.train.precision import compute_device
from weir.train.prefix_pass import prefix_response_logprobs
from weir.train.response_rows import (
    PackedOutput,
    left_pad,
    response_rows,
    to_device,
    token_stats,
)
from weir.train.varlen import install as install_varlen
from weir.train.varlen import varlen_inputs, varlen_refusal

log = logging.getLogger(__name__)

Layout = Literal["packed", "padded", "prefix", "varlen"]
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


def prompt_groups(
    sequences: list[list[int]], response_lengths: list[int], rows: list[int] | None = None
) -> dict[tuple[int, ...], list[int]]:
    """Rows (`rows`, default all) by their prompt (each sequence less its response), in order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in range(len(sequences)) if rows is None else rows:
        seq = sequences[i]
        groups.setdefault(tuple(seq[: len(seq) - response_lengths[i]]), []).append(i)
    return groups


def prefix_micro_batches(
    sequences: list[list[int]], response_lengths: list[int], budget: int
) -> list[list[int]]:
    """Micro-batches of the `prefix` layout: whole prompt groups, at most `budget` computed tokens.

    A micro-batch of G distinct prompts (longest P) and b responses (longest R) computes
    ``G * P + b * (R - 1)`` padded tokens. Groups are taken longest first so that similar lengths
    share a micro-batch; a group over the budget by itself is split into row chunks that each
    still share their prompt.
    """
    if len(sequences) != len(response_lengths):
        raise ValueError("prefix_micro_batches: one response length per sequence")
    groups = prompt_groups(sequences, response_lengths)
    units: list[tuple[int, list[int]]] = []
    for prompt, rows in groups.items():
        rows = sorted(rows, key=lambda i: (-response_lengths[i], i))
        run = response_lengths[rows[0]] - 1  # response tokens a row runs (one-token: none)
        chunk = len(rows) if run <= 0 else max(1, (budget - len(prompt)) // run)
        units += [(len(prompt), rows[k : k + chunk]) for k in range(0, len(rows), chunk)]
    units.sort(key=lambda u: (-(u[0] + response_lengths[u[1][0]]), u[1][0]))
    bins: list[list[int]] = []
    state = (0, 0, 0, 0)  # distinct prompts, longest prompt, longest response, rows
    for p, rows in units:
        r = response_lengths[rows[0]]
        g, lp, lr, nr = state[0] + 1, max(state[1], p), max(state[2], r), state[3] + len(rows)
        if bins and g * lp + nr * max(lr - 1, 0) <= budget:
            bins[-1].extend(rows)
            state = (g, lp, lr, nr)
        else:
            bins.append(list(rows))
            state = (1, p, r, len(rows))
    return [sorted(b) for b in bins]


def micro_batches(
    lengths: list[int],
    budget: int,
    layout: Layout,
    *,
    sequences: list[list[int]] | None = None,
    response_lengths: list[int] | None = None,
) -> list[list[int]]:
    """The micro-batches of `layout` for sequences of `lengths` under a token `budget`.

    `prefix` groups the sequences by prompt when it is given `sequences` and `response_lengths`;
    without them it buckets by length as `padded` does (the prefix forward is exact on any subset).
    """
    if layout in ("packed", "varlen"):
        return pack_by_tokens(lengths, budget)
    if layout == "prefix" and sequences is not None and response_lengths is not None:
        return prefix_micro_batches(sequences, response_lengths, budget)
    return bucket_by_length(lengths, budget)


def choose_layout(
    model: torch.nn.Module,
    packing: str,
    *,
    shared_prompts: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> Layout:
    """Resolve `train.packing` for `model` to one layout (the first of `exact_layouts`).

    `auto`: `packed` with a FlashAttention backend; else, for a caller whose sequences share
    prompts (`shared_prompts`: the RL actor), `prefix` when `prefix_supported` says the model runs
    it exactly (in `compute_dtype`, the dtype the forward computes in); else `padded`. A layout
    asked for by name that cannot run exactly is refused with a one-line error.
    """
    return exact_layouts(
        model, packing, shared_prompts=shared_prompts, compute_dtype=compute_dtype
    )[0]


def exact_layouts(
    model: torch.nn.Module,
    packing: str,
    *,
    shared_prompts: bool = False,
    compute_dtype: torch.dtype | None = None,
    with_varlen: bool = False,
) -> list[Layout]:
    """The layouts that compute `model`'s own numbers, the static choice first.

    A layout named by `packing` is the only one (refused with a one-line error where it cannot
    run exactly). `auto`: `packed` with a FlashAttention backend, else `prefix` where the caller's
    sequences share prompts and its probe passes, then `varlen` where `with_varlen` (a caller that
    picks among them by cost, `weir.train.layout_cost`) and its probe passes, and `padded` always.
    The candidates and the reasons are logged.
    """
    if packing == "prefix":  # asked for: refused up front where it would compute other numbers
        ok, reason = prefix_supported(model, compute_dtype)
        if not ok:
            raise prefix_refusal(reason)
        return ["prefix"]
    if packing == "varlen":
        ok, reason = varlen_supported(model, compute_dtype)
        if not ok:
            raise ValueError(f"train.packing=varlen: {reason}; set train.packing=auto or padded")
        return ["varlen"]
    if packing in ("packed", "padded"):
        return [packing]  # type: ignore[list-item]
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    if attn in VARLEN_ATTENTION:
        log.info("train.packing=auto: packed micro-batches (attention %s is variable-length)", attn)
        return ["packed", "padded"]
    layouts: list[Layout] = []
    why = [f"attention {attn} has no variable-length kernel of its own"]
    if shared_prompts:
        ok, reason = prefix_supported(model, compute_dtype)
        layouts += ["prefix"] if ok else []
        why.append(f"shared prompts: {reason}")
    if with_varlen:
        ok, reason = varlen_supported(model, compute_dtype)
        layouts += ["varlen"] if ok else []
        why.append(reason)
    layouts.append("padded")
    if len(layouts) == 1 or not with_varlen:
        log.info("train.packing=auto: %s micro-batches (%s)", layouts[0], "; ".join(why))
    else:
        log.info(
            "train.packing=auto: the cheapest of %s for each step's lengths (%s)",
            ", ".join(layouts),
            "; ".join(why),
        )
    return layouts


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
    one_pass: bool = False,
    routes: Routes | None = None,
) -> PackedOutput:
    """Log-probs (and entropy) of the last `response_lengths[i]` tokens of each sequence.

    `one_pass` (the `prefix` layout on FSDP ranks): exactly two root forwards per call, so that
    every rank's collectives stay in step (see `prefix_response_logprobs`). `routes`: the
    engine's recorded routing of each sequence, replayed in every forward (an MoE model with
    `algo.routing_replay`; `weir.data.moe_routing`).

    logp_t = log_softmax(z_{t-1} / T)[x_t], computed only at response positions; both layouts give
    the same numbers (up to the summation order of the attention kernels).
    """
    if layout == "prefix":
        if visions is not None and any(v is not None for v in visions):
            layout = "padded"  # prompts with pixels are not shared (their KV holds the image)
        else:
            return prefix_response_logprobs(
                model,
                sequences,
                response_lengths,
                temperature=temperature,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
                pad_to=pad_to,
                chunk_size=chunk_size,
                one_pass=one_pass,
                routes=routes,
            )
    options = dict(
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        pad_to=pad_to,
        chunk_size=chunk_size,
        visions=visions,
        routes=routes,
    )
    if layout == "padded":
        return padded_response_logprobs(model, sequences, response_lengths, **options)
    varlen = layout == "varlen"
    return packed_response_logprobs(model, sequences, response_lengths, varlen=varlen, **options)


def pack(
    sequences: list[list[int]], response_lengths: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """The `packed` layout's one row: (ids, position ids restarting at 0 per sequence, the row
    positions whose next token is a response token, i.e. the states that predict the responses)."""
    flat: list[int] = []
    positions: list[int] = []
    keep: list[int] = []
    for seq, n in zip(sequences, response_lengths, strict=True):
        end = len(flat) + len(seq)
        keep.extend(range(end - n - 1, end - 1))
        flat.extend(seq)
        positions.extend(range(len(seq)))
    return flat, positions, keep


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
    varlen: bool = False,
    routes: Routes | None = None,
) -> PackedOutput:
    """The `packed` layout: one row, position ids restarting per sequence (see the module
    docstring); with `varlen`, the `varlen` layout: the same row through the variable-length
    attention of `weir.train.varlen` (no mask)."""
    device = compute_device(model)
    flat, positions, keep = pack(sequences, response_lengths)
    input_ids = to_device(torch.tensor([flat]), device)
    extra: dict = {"position_ids": to_device(torch.tensor([positions]), device)}
    vm = vision_model(model)
    if vm is not None:  # even without images: the 1-D text positions keep the sequences apart
        extra = vm.packed_inputs(sequences, visions or [None] * len(sequences))
    elif varlen:
        install_varlen()
        extra.update(varlen_inputs([len(s) for s in sequences], device))
    keep_idx = to_device(torch.tensor(keep), device)
    replay = None
    if routes is not None:
        replay = torch.cat([routes.span(i, 0, len(s)) for i, s in enumerate(sequences)])
    with replaying(None if replay is None else to_device(replay, device)):
        out = model(input_ids=input_ids, use_cache=False, logits_to_keep=keep_idx, **extra)
    logp, ent = token_stats(
        out.logits[0],
        input_ids[0, keep_idx + 1],
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        chunk_size=chunk_size,
    )
    return PackedOutput(
        response_rows(logp, response_lengths, pad_to),
        response_rows(ent, response_lengths, pad_to) if ent is not None else None,
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
    routes: Routes | None = None,
) -> PackedOutput:
    """The `padded` layout: one left-padded row per sequence.

    Left padding lines every response up against the row's end, so the LM head runs on the last
    R + 1 positions only (R the longest response). The chunked log-prob runs over that whole
    (b, R + 1) block as a view (no gather copy of the logits); the columns that belong to no
    response get a dummy target and are dropped afterwards.
    """
    device = compute_device(model)
    b, width = len(sequences), max(len(s) for s in sequences)
    r = max(response_lengths)
    ids, attn, positions = left_pad(sequences)
    ids, attn = to_device(ids, device), to_device(attn, device)
    extra = {"position_ids": to_device(positions, device)}
    if visions is not None and any(v is not None for v in visions):
        vm = vision_model(model)
        if vm is None:
            raise ValueError("sequences with images for a text-only model")
        extra, _ = vm.padded_inputs(sequences, visions, width)
    replay = None
    if routes is not None:
        replay = routes.left_padded([len(s) for s in sequences], width).to(device)
    with replaying(replay):
        out = model(
            input_ids=ids,
            attention_mask=attn,
            use_cache=False,
            logits_to_keep=r + 1,
            **extra,
        )
    logits = out.logits  # (b, r + 1, V): positions width - r - 1 ... width - 1
    targets = torch.cat([ids[:, width - r :], torch.zeros_like(ids[:, :1])], dim=1)
    logp, ent = token_stats(
        logits.reshape(b * (r + 1), -1),
        targets.reshape(-1),
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        chunk_size=chunk_size,
    )
    lengths = to_device(torch.tensor(response_lengths), device)
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


def prefix_refusal(reason: str) -> ValueError:
    """The one-line error for `train.packing=prefix` asked for where it cannot run exactly."""
    return ValueError(f"train.packing=prefix: {reason}; set train.packing=auto or padded")


def prefix_refused_unprobed(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run the `prefix` layout exactly, known without running it (None: only the
    probe of `prefix_supported` can tell): a vision-language model, gradient checkpointing (HF
    drops the cache in a checkpointed forward), windowed attention (the cache would be windowed)."""
    if vision_model(model) is not None:
        return "a vision-language model's prompts carry pixels (their KV is not shared)"
    cfg = getattr(model, "config", None)
    if is_checkpointing(model):
        return "prefix off: gradient checkpointing drops the prompt cache"
    layer_types = getattr(cfg, "layer_types", None) or []
    windowed = any("sliding" in str(t) or "chunked" in str(t) for t in layer_types)
    if (
        windowed
        or getattr(cfg, "sliding_window", None)
        or getattr(cfg, "attention_chunk_size", None)
    ):
        return "prefix off: windowed attention"
    return None


def prefix_supported(
    model: torch.nn.Module, compute_dtype: torch.dtype | None = None
) -> tuple[bool, str]:
    """Whether the `prefix` layout computes on `model` what `padded` computes, and why (not).

    Refused without probing where `prefix_refused_unprobed` says so. Otherwise `_probe` runs it
    against `padded`.
    """
    refused = prefix_refused_unprobed(model)
    if refused is not None:
        return False, refused
    err = _probe(model, "prefix", compute_dtype)
    if isinstance(err, str):
        return False, f"prefix off: {err}"
    return True, f"prefix on (probe within {err:.1g} nats/token of padded)"


def varlen_supported(
    model: torch.nn.Module, compute_dtype: torch.dtype | None = None
) -> tuple[bool, str]:
    """Whether the `varlen` layout computes on `model` what `padded` computes, and why (not):
    refused where `weir.train.varlen.varlen_refusal` says so, else probed by `_probe`."""
    refused = varlen_refusal(model)
    if refused is not None:
        return False, f"varlen off: {refused}"
    err = _probe(model, "varlen", compute_dtype)
    if isinstance(err, str):
        return False, f"varlen off: {err}"
    return True, f"varlen on (probe within {err:.1g} nats/token of padded)"


def _probe(
    model: torch.nn.Module, layout: Layout, compute_dtype: torch.dtype | None
) -> float | str:
    """Mean |`layout` - `padded`| log-prob per token on two prompts with two responses each (one
    token, and several), without gradients, as the caller's forward runs (under its autocast, or
    FSDP's gathered shards); a float, or why the probe failed. It must be within rounding of
    `compute_dtype` (default: the parameters' dtype), as `weir.config.devices.rounding_tolerance`
    bounds it, or the returned string says by how much it is not."""
    vocab = int(model.get_output_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    a, b = tok(5), tok(3)
    seqs = [a + tok(4), b + tok(1), a + tok(1), b + tok(6)]
    lens = [4, 1, 1, 6]
    dtype = compute_dtype or next(model.parameters()).dtype
    tol = rounding_tolerance(dtype, compute_device(model))
    was_training = model.training
    model.eval()
    try:
        # uncompiled (`train.fuse=compile`): the probe's shapes would cost compiles of their own
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            mine = response_logprobs(model, seqs, lens, layout=layout).logprobs
            ref = padded_response_logprobs(model, seqs, lens).logprobs
    except Exception as err:  # an architecture whose forward takes no shared cache / no kwargs
        return f"the probe failed ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    mask = torch.arange(ref.shape[1])[None] < torch.tensor(lens)[:, None]
    err = float((mine - ref).abs()[mask.to(ref.device)].mean())
    if not err <= tol:
        return f"the probe differs from padded by {err:.3g} nats/token"
    return err
