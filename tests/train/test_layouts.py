"""Packed and padded micro-batches compute the same log-probs and gradients; on CPU (no
variable-length attention kernel) `auto` picks padded, which costs less for many short sequences."""

from __future__ import annotations

import logging

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, Qwen3Config

from weir.train.packing import (
    bucket_by_length,
    choose_layout,
    micro_batches,
    pack,
    pack_by_tokens,
    response_logprobs,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(16, 1024))
def test_bucketed_micro_batches_cover_every_sequence_within_the_padded_budget(lengths, budget):
    bins = bucket_by_length(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        padded = len(b) * max(lengths[i] for i in b)
        assert padded <= budget or len(b) == 1
    assert micro_batches(lengths, budget, "padded") == bins
    assert micro_batches(lengths, budget, "packed") == pack_by_tokens(lengths, budget)


_MODEL = None


def _model() -> torch.nn.Module:
    global _MODEL
    if _MODEL is None:
        config = Qwen3Config(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
        torch.manual_seed(0)
        _MODEL = AutoModelForCausalLM.from_config(config).eval()
    return _MODEL


def _run(layout: str, seqs, lens, temperature: float):
    model = _model()
    model.zero_grad(set_to_none=True)
    out = response_logprobs(
        model,
        seqs,
        lens,
        layout=layout,
        temperature=temperature,
        with_entropy=True,
        entropy_grad=True,
        pad_to=max(lens) + 2,
        chunk_size=7,
    )
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    return out, torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@settings(max_examples=8, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 12), st.integers(1, 10)), min_size=1, max_size=5),
    st.sampled_from([1.0, 0.7]),
    st.randoms(use_true_random=False),
)
def test_packed_and_padded_layouts_give_equal_logprobs_and_gradients(shapes, temperature, rnd):
    seqs = [[rnd.randrange(97) for _ in range(p + r)] for p, r in shapes]
    lens = [r for _, r in shapes]
    packed, g_packed = _run("packed", seqs, lens, temperature)
    padded, g_padded = _run("padded", seqs, lens, temperature)
    assert torch.allclose(packed.logprobs, padded.logprobs, atol=1e-5)
    assert torch.allclose(packed.entropy, padded.entropy, atol=1e-5)
    assert torch.allclose(g_packed, g_padded, atol=1e-5)
    for i, n in enumerate(lens):  # positions past each response are exactly zero
        assert torch.all(padded.logprobs[i, n:] == 0) and torch.all(packed.logprobs[i, n:] == 0)


def test_auto_picks_padded_without_a_varlen_kernel_and_says_so(caplog):
    model = _model()
    with caplog.at_level(logging.INFO, logger="weir.train.packing"):
        assert choose_layout(model, "auto") == "padded"
    assert "padded micro-batches" in caplog.text and "sdpa" in caplog.text
    assert choose_layout(model, "packed") == "packed"
    model.config._attn_implementation = "flash_attention_2"
    try:
        assert choose_layout(model, "auto") == "packed"
    finally:
        model.config._attn_implementation = "sdpa"


def test_padded_costs_fewer_operations_than_packed_for_many_short_sequences():
    """64 sequences of 16-48 tokens in one 2k-token micro-batch: packed attends over an L x L
    block-diagonal mask (L = total tokens), padded over each short row. Counted in FLOPs with eager
    attention, whose matmuls the counter sees (SDPA runs the same products)."""
    config = Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 49, (64,), generator=g).tolist()
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]
    lens = [n // 2 for n in lengths]
    budget = 4096
    flops = {}
    for layout in ("packed", "padded"):
        with FlopCounterMode(display=False) as counter:
            for mb in micro_batches(lengths, budget, layout):
                response_logprobs(
                    model, [seqs[i] for i in mb], [lens[i] for i in mb], layout=layout
                ).logprobs.sum().backward()
        flops[layout] = counter.get_total_flops()
    assert flops["padded"] < 0.5 * flops["packed"], flops


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.integers(1, 5)),
        min_size=1,
        max_size=5,
    )
)
def test_pack_keeps_the_states_that_predict_each_response(shapes: list[tuple[int, int]]) -> None:
    """`pack`: the row is the sequences end to end, positions restart at 0, and the kept states
    are exactly those whose next token is a response token (in order)."""
    sequences, lengths, token = [], [], 0
    for prompt_len, response_len in shapes:
        sequences.append(list(range(token, token + prompt_len + response_len)))
        lengths.append(response_len)
        token += prompt_len + response_len
    flat, positions, keep = pack(sequences, lengths)
    assert flat == [t for s in sequences for t in s]
    assert positions == [i for s in sequences for i in range(len(s))]
    responses = [t for s, n in zip(sequences, lengths, strict=True) for t in s[len(s) - n :]]
    assert [flat[k + 1] for k in keep] == responses
