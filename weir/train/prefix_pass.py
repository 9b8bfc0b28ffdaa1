"""The `prefix` layout of the trainer's forward: the sequences that share a prompt run it once.

A prompt pass over the distinct prompts (left-padded) builds their KV cache, the cache rows are
gathered to one per sequence, and response passes run the responses (right-padded) on top of it;
the gather's backward adds every response's gradient into its prompt. `weir.train.packing` says
when this layout is chosen and probes that a model runs it exactly.
"""

from __future__ import annotations

import torch

from weir.data.moe_routing import Routes, replaying
from weir.hf_compat import cache_kwargs
from weir.train.precision import compute_device
from weir.train.response_rows import PackedOutput, left_pad, to_device, token_stats

RESPONSE_PASS_TOKENS = 256
"""What one more response pass costs beyond its tokens (its Python and the per-op work of its
forward and backward), in tokens of a small model on a CPU; `response_buckets` splits a
micro-batch's responses only where that saves more padding than this (on a CPU only)."""


def response_buckets(lengths: list[int], pass_tokens: int | None = None) -> list[tuple[int, int]]:
    """Split responses sorted longest first into runs ``[lo, hi)`` that each get a pass padded to
    their first (longest) length, minimising the tokens run plus `pass_tokens` per pass:

        cost = sum over buckets of (hi - lo) * (lengths[lo] - 1) + pass_tokens

    (a response of n tokens runs n - 1 of them; a bucket of one-token responses runs none and costs
    nothing). Exact by dynamic programming over the cut points between different lengths.
    """
    per_pass = RESPONSE_PASS_TOKENS if pass_tokens is None else pass_tokens
    n = len(lengths)
    if n == 0:
        return []
    starts = [i for i in range(n) if i == 0 or lengths[i] != lengths[i - 1]] + [n]

    def cost(lo: int, hi: int) -> int:
        run = lengths[lo] - 1
        return (hi - lo) * run + per_pass if run > 0 else 0

    best = {0: (0, -1)}  # cut position -> (cost of the rows before it, previous cut)
    for hi in starts[1:]:
        best[hi] = min((best[lo][0] + cost(lo, hi), lo) for lo in starts if lo < hi)
    cuts, at = [], n
    while at > 0:
        prev = best[at][1]
        cuts.append((prev, at))
        at = prev
    return cuts[::-1]


def prefix_response_logprobs(
    model: torch.nn.Module,
    sequences: list[list[int]],
    response_lengths: list[int],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    pad_to: int | None = None,
    chunk_size: int = 256,
    one_pass: bool = False,
    routes: Routes | None = None,
) -> PackedOutput:
    """The `prefix` layout: each distinct prompt runs once (see the module docstring).

    With `routes` (routing replay), sequences share a prompt pass only where their prompts also
    have the same recorded routing.

    With `one_pass` the responses run in one pass, run even when every response is one token
    long: the model's forward runs exactly twice, as FSDP ranks need (each forward gathers every
    unit's parameters, so every rank must run the same number).

    The prompt pass keeps the logits of each prompt's last position (they predict every response's
    first token); the response pass runs response tokens 0 ... n_i - 2 at positions
    ``len(prompt_i) + j`` on the gathered prompt cache and predicts tokens 1 ... n_i - 1.
    """
    from transformers import DynamicCache

    device = compute_device(model)
    b = len(sequences)
    prompt_of: dict[tuple[int, ...], int] = {}
    rows_prompt: list[int] = []
    owner: list[int] = []  # the sequence whose prompt (and routing) each distinct prompt is
    for i, (seq, n) in enumerate(zip(sequences, response_lengths, strict=True)):
        if n < 1 or n >= len(seq):
            raise ValueError(
                f"prefix layout: a response of {n} tokens in a sequence of {len(seq)} (need a "
                "prompt of at least one token and a response of at least one)"
            )
        key: tuple = tuple(seq[: len(seq) - n])
        if routes is not None:
            key = (key, routes.span(i, 0, len(seq) - n).numpy().tobytes())
        if key not in prompt_of:
            owner.append(i)
        rows_prompt.append(prompt_of.setdefault(key, len(prompt_of)))
    prompts = [sequences[i][: len(sequences[i]) - response_lengths[i]] for i in owner]
    p_ids, p_mask, p_pos = left_pad(prompts)
    p_mask = to_device(p_mask, device)
    cache = DynamicCache(config=model.config)
    replay = None
    if routes is not None:
        replay = to_device(
            routes.left_padded([len(q) for q in prompts], p_ids.shape[1], owner), device
        )
    with replaying(replay):
        first = model(
            input_ids=to_device(p_ids, device),
            attention_mask=p_mask,
            position_ids=to_device(p_pos, device),
            **cache_kwargs(model, cache),
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]  # (g, V): predicts every response's first token
    row_prompt = to_device(torch.tensor(rows_prompt), device)
    lengths = to_device(torch.tensor(response_lengths), device)
    first_targets = torch.tensor(
        [seq[len(seq) - n] for seq, n in zip(sequences, response_lengths, strict=True)]
    )
    logp0, ent0 = token_stats(
        first.index_select(0, row_prompt),
        to_device(first_targets, device),
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        chunk_size=chunk_size,
    )
    logp, ent = logp0[:, None], None if ent0 is None else ent0[:, None]
    r = max(response_lengths) - 1  # response tokens that are run (all but each one's last)
    run_width = max(r, 1) if one_pass else r
    if run_width > 0:
        ids = torch.zeros(b, run_width + 1, dtype=torch.long)
        for i, (seq, n) in enumerate(zip(sequences, response_lengths, strict=True)):
            ids[i, :n] = torch.tensor(seq[len(seq) - n :], dtype=torch.long)
        ids = to_device(ids, device)
        prompt_len = p_mask.sum(1)
        # Rows longest first, in buckets of similar length: each bucket's pass is padded to its own
        # longest response, not the micro-batch's.
        order = sorted(range(b), key=lambda i: (-response_lengths[i], i))
        # On a GPU a pass costs thousands of kernel launches, worth far more than the padding it
        # saves on any but extreme length spreads: one pass there (not measured: no GPU yet).
        buckets = (
            response_buckets([response_lengths[i] for i in order])
            if device.type == "cpu" and not one_pass
            else [(0, b)]
        )
        pieces_logp, pieces_ent = [], []
        for lo, hi in buckets:
            rows = order[lo:hi]
            width = run_width if one_pass else response_lengths[rows[0]] - 1
            if width == 0:  # one-token responses: their only log-prob came from the prompt pass
                pieces_logp.append(logp0.new_zeros(len(rows), r))
                if ent is not None:
                    pieces_ent.append(logp0.new_zeros(len(rows), r))
                continue
            sel = to_device(torch.tensor(rows), device)
            their_prompt = row_prompt.index_select(0, sel)
            sub = DynamicCache(config=model.config)
            # each row's prompt KV (a differentiable gather)
            for k, layer in enumerate(cache.layers):
                sub.update(
                    layer.keys.index_select(0, their_prompt),
                    layer.values.index_select(0, their_prompt),
                    k,
                )
            col = torch.arange(width, device=device)
            run_mask = (col[None] < (lengths.index_select(0, sel) - 1)[:, None]).long()
            attn = torch.cat([p_mask.index_select(0, their_prompt), run_mask], dim=1)
            run = ids.index_select(0, sel)[:, : width + 1]
            replay = None
            if routes is not None:  # response token j of row i sits at position len(prompt) + j
                starts = [len(sequences[i]) - response_lengths[i] for i in rows]
                replay = torch.cat(
                    [routes.span(i, p, p + width) for i, p in zip(rows, starts, strict=True)]
                )
            with replaying(None if replay is None else replay.to(device)):
                logits = model(
                    input_ids=run[:, :width],
                    attention_mask=attn,
                    position_ids=prompt_len.index_select(0, their_prompt)[:, None] + col[None],
                    **cache_kwargs(model, sub),
                    use_cache=True,
                ).logits  # (rows, width, V): column j predicts response token j + 1
            rest, rest_ent = token_stats(
                logits.reshape(len(rows) * width, -1),
                run[:, 1:].reshape(-1),
                temperature=temperature,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
                chunk_size=chunk_size,
            )
            pad = (0, r - width)  # negative (one_pass, one-token responses): the unused column
            pieces_logp.append(torch.nn.functional.pad(rest.view(len(rows), width), pad))
            if ent is not None and rest_ent is not None:
                pieces_ent.append(torch.nn.functional.pad(rest_ent.view(len(rows), width), pad))
        back = torch.empty(b, dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(b)  # bucket order -> the caller's row order
        back = to_device(back, device)
        logp = torch.cat([logp, torch.cat(pieces_logp).index_select(0, back)], dim=1)
        if ent is not None:
            ent = torch.cat([ent, torch.cat(pieces_ent).index_select(0, back)], dim=1)
    valid = torch.arange(logp.shape[1], device=device)[None] < lengths[:, None]

    def finish(x: torch.Tensor) -> torch.Tensor:
        x = torch.where(valid, x, 0.0)
        if pad_to is not None and x.shape[1] < pad_to:
            x = torch.nn.functional.pad(x, (0, pad_to - x.shape[1]))
        return x

    return PackedOutput(finish(logp), finish(ent) if ent is not None else None)
