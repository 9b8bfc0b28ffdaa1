"""The fixed-shape decode step that CUDA graphs replay (weir.engine.graphs), run without capture on
the CPU (``cuda_graphs="eager"``): the same tokens as the eager engine and log-probs within rounding,
through admissions, retirements, reallocated slabs, sliding windows, eager attention and weight
updates; and a fixed-shape step that differs is dropped after its first step."""

from __future__ import annotations

import time

import pytest
import torch
from engine_helpers import EOS, PAD, assert_parity, make_prompts, wait_steps
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from weir.engine import SamplingParams, TorchEngine
from weir.engine.decode import DecodeForward
from weir.engine.graphs import StaticDecode, row_bucket
from weir.tasks.tiny_archs import WINDOW, build_arch_model

BOUND = 1e-4  # float32 on a CPU: rounding of two summation orders, far below a wrong mask's 0.1


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fixed_shape")
    return {name: build_arch_model(root / name, name, seed=7) for name in ("qwen3", "mistral")}


def run(model, prompts, params, **kw):
    with TorchEngine(model, eos_token_ids=[EOS], pad_token_id=PAD, **kw) as engine:
        out = engine.generate_many(prompts, params)
        return out, engine.stats()


def assert_close(a, b):
    for ca, cb in zip(a, b, strict=True):
        for x, y in zip(ca, cb, strict=True):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            err = (torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max().item()
            assert err < BOUND, err


@given(st.integers(1, 600), st.integers(1, 600))
def test_row_buckets_are_powers_of_two_within_the_slabs(rows, capacity):
    capacity = max(capacity, rows)
    b = row_bucket(rows, capacity)
    assert rows <= b <= capacity
    assert b == capacity or (b >= 8 and b & (b - 1) == 0 and (b == 8 or b // 2 < rows))


@pytest.mark.parametrize(
    ("arch", "attn"), [("qwen3", "sdpa"), ("qwen3", "eager"), ("mistral", "sdpa")]
)
def test_fixed_shape_steps_give_the_eager_engines_tokens(arch_dirs, arch, attn):
    """Rows of different prompt lengths and budgets retire at different steps (the row bucket
    shrinks from 32 to 8 and padding rows come and go); mistral's sliding window (8) drops keys."""
    model = AutoModelForCausalLM.from_pretrained(arch_dirs[arch], attn_implementation=attn).eval()
    prompts = make_prompts(6, 3, 2 * WINDOW, seed=3)
    params = [
        SamplingParams(n=3, max_new_tokens=4 + 5 * i, temperature=0.9, seed=20 + i)
        for i in range(6)
    ]
    fixed, stats = run(model, prompts, params, cuda_graphs="eager")
    assert stats["decode_fixed_shape"] == 1.0 and stats["decode_graphs"] == 0.0
    eager, stats = run(model, prompts, params, cuda_graphs=False)
    assert stats["decode_fixed_shape"] == 0.0
    assert_close(fixed, eager)
    assert any(len(c.token_ids) > WINDOW for comps in fixed for c in comps)
    for prompt, comps, p in zip(prompts, fixed, params, strict=True):
        for c in comps:
            assert_parity(model, prompt, c, temperature=p.temperature)


def test_newcomers_reallocations_and_a_weight_update_between_fixed_shape_steps(arch_dirs):
    """Requests joining a running batch (their prompts longer than its columns), slabs grown and
    reallocated, and an in-place weight update with the KV rebuilt: each completion's log-probs
    are the trainer's for the weights of each token's version."""
    model = AutoModelForCausalLM.from_pretrained(arch_dirs["qwen3"]).eval()
    old = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    first = make_prompts(2, 3, 6, seed=4)
    later = make_prompts(5, 14, 20, seed=5)
    with TorchEngine(model, eos_token_ids=[], pad_token_id=PAD, cuda_graphs="eager") as engine:
        running = engine.submit_many(first, SamplingParams(n=2, max_new_tokens=40, seed=1))
        wait_steps(engine, 5)
        joined = engine.submit_many(later, SamplingParams(n=4, max_new_tokens=12, seed=2))
        for f in joined:
            f.result(timeout=60)
        engine.update_weights_sync(new.items(), version=1)
        done = [f.result(timeout=60) for f in running]
        stats = engine.stats()
    assert stats["decode_fixed_shape"] == 1.0 and stats["kv_reallocs"] >= 1
    for prompt, comps in zip(later, [f.result() for f in joined], strict=True):
        for c in comps:
            check_by_version(model, old, new, prompt, c)
    for prompt, comps in zip(first, done, strict=True):
        for c in comps:
            assert len(c.token_ids) == 40
            check_by_version(model, old, new, prompt, c)


def check_by_version(model, old, new, prompt, c):
    """Tokens of version 0 against `old` weights, of version 1 against `new`, each on the whole
    context (the KV of a row in flight is rebuilt after the update)."""
    for version, weights in ((0, old), (1, new)):
        idx = [i for i, v in enumerate(c.versions) if v == version]
        if not idx:
            continue
        model.load_state_dict(weights)
        with torch.no_grad():
            ids = torch.tensor([prompt + c.token_ids])
            lp = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            ref = lp[torch.arange(len(c.token_ids)), torch.tensor(c.token_ids)]
        got = torch.tensor(c.logprobs)
        err = (got[idx] - ref[idx]).abs().max().item()
        assert err < 1e-4, (version, err)


def test_a_fixed_shape_step_that_differs_is_dropped_after_its_first_step(arch_dirs, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(arch_dirs["qwen3"]).eval()
    prompts = make_prompts(3, 4, 12, seed=6)
    params = SamplingParams(n=2, max_new_tokens=10, temperature=0.9, seed=3)
    calls = []
    real = StaticDecode.__call__

    def off(self, batch):
        calls.append(1)
        return real(self, batch) + torch.linspace(
            0, 0.5, model.config.vocab_size
        )  # a wrong mask's size

    monkeypatch.setattr(StaticDecode, "__call__", off)
    out, stats = run(model, prompts, params, cuda_graphs="eager")
    assert stats["decode_fixed_shape"] == 0.0 and len(calls) == 1
    reference, _ = run(model, prompts, params, cuda_graphs=False)
    assert_close(out, reference)


def test_cuda_graphs_are_off_on_a_cpu_and_an_unknown_value_is_refused(arch_dirs):
    model = AutoModelForCausalLM.from_pretrained(arch_dirs["qwen3"]).eval()
    _, stats = run(model, make_prompts(1, 3, 4, seed=1), SamplingParams(max_new_tokens=2))
    assert stats["decode_fixed_shape"] == 0.0  # default True: graphs need CUDA
    with pytest.raises(ValueError, match="cuda_graphs"):
        TorchEngine(model, eos_token_ids=[EOS], pad_token_id=PAD, cuda_graphs="yes")


def test_rotary_embeddings_that_rescale_from_positions_are_never_captured(arch_dirs):
    from weir.engine.graphs import _static_rope

    model = AutoModelForCausalLM.from_pretrained(arch_dirs["qwen3"]).eval()
    direct = DecodeForward.build(model, per_layer_type=False)
    assert _static_rope(direct)
    for kind in ("dynamic", "longrope"):
        direct.rotary.rope_type = kind
        assert not _static_rope(direct)
    direct.rotary.rope_type = {"full_attention": "default", "sliding_attention": "dynamic"}
    assert not _static_rope(direct)


def test_sleep_and_an_idle_release_drop_the_fixed_shape_buffers(arch_dirs):
    """The buffers (on CUDA, the graphs and their memory pool) point at the KV slabs: a sleep or an
    idle release drops them with the slabs, and decoding afterwards builds them anew and gives the
    same tokens (log-probs within rounding: the first generation's first steps ran the eager
    forwards of the start-up checks)."""
    model = AutoModelForCausalLM.from_pretrained(arch_dirs["qwen3"]).eval()
    prompts = make_prompts(4, 3, 10, seed=5)
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0.0)
    with TorchEngine(
        model, eos_token_ids=[EOS], pad_token_id=PAD, cuda_graphs="eager", kv_idle_release_s=None
    ) as engine:
        static = engine._static
        first = engine.generate_many(prompts, params)
        assert static._entries and static._slabs is not None
        engine.sleep_sync()
        assert not static._entries and static._slabs is None
        engine.wake_sync()
        assert_close(engine.generate_many(prompts, params), first)
        assert static._entries
    with TorchEngine(
        model, eos_token_ids=[EOS], pad_token_id=PAD, cuda_graphs="eager", kv_idle_release_s=0.05
    ) as engine:
        static = engine._static
        assert_close(engine.generate_many(prompts, params), first)
        deadline = time.monotonic() + 10
        while engine.kv_stats()["kv_releases"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.kv_stats()["kv_releases"] >= 1
        assert not static._entries and static._slabs is None
