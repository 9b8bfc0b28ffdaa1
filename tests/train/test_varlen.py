"""The `varlen` layout (a packed row through a variable-length attention kernel, no mask) gives
the padded and prefix layouts' log-probs, entropy and gradients on CPU, on every architecture it
accepts (sliding windows included), and refuses the ones it cannot run exactly; its route through
transformers' `sdpa` leaves every other forward unchanged and builds no mask."""

from __future__ import annotations

import inspect
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, Qwen3Config

from weir.train import varlen
from weir.train.packing import exact_layouts, response_logprobs, varlen_supported

VOCAB = 97
TOL_LOGP = 1e-5  # fp32: the kernels' summation orders differ (seen: up to 1.5e-6)
TOL_GRAD = 1e-4  # absolute, with rtol 1e-4 (seen: up to 1.1e-5)


def _qwen3(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


_MODEL = _qwen3()


def _run(model, layout: str, seqs, lens, temperature: float = 1.0):
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
        chunk_size=5,
    )
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return out, grads


@settings(max_examples=8, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 9), st.lists(st.integers(1, 8), min_size=1, max_size=3)),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from([1.0, 0.7]),
    st.randoms(use_true_random=False),
)
def test_varlen_gives_the_padded_and_prefix_logprobs_entropy_and_gradients(
    shapes, temperature, rnd
):
    seqs, lens = [], []
    for p, responses in shapes:
        prompt = [rnd.randrange(VOCAB) for _ in range(p)]
        for n in responses:
            seqs.append(prompt + [rnd.randrange(VOCAB) for _ in range(n)])
            lens.append(n)
    got, g_varlen = _run(_MODEL, "varlen", seqs, lens, temperature)
    for layout in ("padded", "prefix"):
        want, g_want = _run(_MODEL, layout, seqs, lens, temperature)
        assert torch.allclose(got.logprobs, want.logprobs, atol=TOL_LOGP), layout
        assert torch.allclose(got.entropy, want.entropy, atol=TOL_LOGP), layout
        assert torch.allclose(g_varlen, g_want, atol=TOL_GRAD, rtol=1e-4), layout
    for i, n in enumerate(lens):  # positions past each response are exactly zero
        assert torch.all(got.logprobs[i, n:] == 0) and torch.all(got.entropy[i, n:] == 0)


ACCEPTED = [
    "llama3",
    "qwen2",  # a sliding window on the first layer, full attention above it
    "qwen3",
    "qwen3_moe",
    "mistral",  # one sliding window for every layer
    "phi3_window",
    "gemma3",  # hybrid windows, query_pre_attn_scalar scaling
    "olmo2",
    "deepseek_v3",  # MLA: value heads narrower than query/key heads
]


def _arch_batch(vocab: int):
    """3 prompts of 3-12 tokens, 3 responses of 1-15 each: past the tiny models' window (8)."""
    rnd = random.Random(1)
    seqs, lens = [], []
    for _ in range(3):
        prompt = [rnd.randrange(vocab) for _ in range(rnd.randint(3, 12))]
        for _ in range(3):
            n = rnd.randint(1, 15)
            seqs.append(prompt + [rnd.randrange(vocab) for _ in range(n)])
            lens.append(n)
    return seqs, lens


def _arch(name: str) -> torch.nn.Module:
    """weir's tiny model of architecture `name` (docs/models.md), built in memory."""
    from weir.tasks.tiny_archs import arch_config

    torch.manual_seed(0)
    config = arch_config(name)
    config._attn_implementation = None  # what from_pretrained picks: sdpa where supported
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("body", ["per sequence", "flash call"])
@pytest.mark.parametrize("name", ACCEPTED)
def test_varlen_equals_padded_on_real_architectures(name, body, monkeypatch):
    """`flash call`: the CUDA path's arguments (the window as the kernel's `window_size`, MLA's
    value heads zero-padded to the query/key head dim under the qk head dim's scale and cut back,
    grouped-query heads expanded) through a stand-in for torch 2.11's kernel that computes its
    documented semantics per sequence (`_fake_varlen_attn`), in float32."""
    if body == "flash call":
        monkeypatch.setattr(varlen, "_kernel", lambda: _fake_varlen_attn("2.11"))
        monkeypatch.setattr(varlen, "flash_runs", lambda *a: True)
    model = _arch(name)
    assert model.config._attn_implementation == "sdpa"
    assert varlen_supported(model)[0]
    assert "varlen" in exact_layouts(model, "auto", shared_prompts=True, with_varlen=True)
    seqs, lens = _arch_batch(model.config.vocab_size)
    got, g_got = _run(model, "varlen", seqs, lens)
    want, g_want = _run(model, "padded", seqs, lens)
    assert torch.allclose(got.logprobs, want.logprobs, atol=TOL_LOGP)
    assert torch.allclose(g_got, g_want, atol=TOL_GRAD, rtol=1e-4)


@pytest.mark.parametrize(
    "name, reason",
    [("gemma2", "soft-capping|attention 'eager'"), ("gpt_oss", "attention 'eager'|sinks")],
)
def test_varlen_is_refused_where_it_cannot_run_exactly(name, reason):
    model = _arch(name)
    ok, why = varlen_supported(model)
    assert not ok and why.startswith("varlen off: ")
    assert any(r in why for r in reason.split("|")), why
    assert "varlen" not in exact_layouts(model, "auto", shared_prompts=True, with_varlen=True)
    with pytest.raises(ValueError, match=r"^train.packing=varlen: varlen off: .*; set train"):
        exact_layouts(model, "varlen")


def test_a_softcapped_model_under_sdpa_is_refused_before_it_runs():
    model = _qwen3()
    model.config.attn_logit_softcapping = 30.0
    assert varlen_supported(model) == (
        False,
        "varlen off: attention soft-capping (the varlen kernel has none)",
    )


def test_the_route_leaves_other_forwards_alone_and_builds_no_mask(monkeypatch):
    """After `install`, a padded forward computes bit for bit what transformers' sdpa computes,
    the config still says sdpa, and the varlen forward never calls a mask builder (the packed
    layout's forward does: the check has power)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0
    with torch.no_grad():
        before = _MODEL(input_ids=ids, attention_mask=mask).logits
        varlen.install()
        varlen.install()  # once only: no route around the route
        after = _MODEL(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after)
    assert _MODEL.config._attn_implementation == "sdpa"
    built = []
    real = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping,
        "sdpa",
        lambda *a, **k: built.append(1) or real(*a, **k),
    )
    seqs, lens = [[1, 2, 3, 4, 5], [6, 7, 8]], [2, 1]
    with torch.no_grad():
        response_logprobs(_MODEL, seqs, lens, layout="varlen")
        assert not built
        response_logprobs(_MODEL, seqs, lens, layout="packed")
        assert built


def _fake_varlen_attn(signature: str):
    """torch's varlen_attn as 2.10, 2.11 and 2.12 declare it, computed by SDPA per sequence with
    the documented semantics (window (left, right) around the query, -1 unbounded; no GQA
    without `enable_gqa`), so that the CUDA path's argument handling runs on a CPU."""

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, scale, window, gqa):
        if q.shape[1] != k.shape[1] and not gqa:
            raise ValueError("heads differ without enable_gqa")
        if q.shape[-1] != v.shape[-1]:
            raise ValueError("FlashAttention-2 wants one head dim")
        b = cu_q.tolist()
        out = []
        for s, e in zip(b, b[1:], strict=False):
            i = torch.arange(e - s)
            d = i[:, None] - i[None]
            allowed = torch.ones(e - s, e - s, dtype=torch.bool)
            if window[0] >= 0:
                allowed &= d <= window[0]
            if window[1] >= 0:
                allowed &= -d <= window[1]
            qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=gqa
            )
            out.append(o.transpose(0, 1))
        return torch.cat(out)

    if signature == "2.10":

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
            return attend(
                q, k, v, cu_q, cu_k, max_q, max_k, None, (-1, 0 if is_causal else -1), False
            )

    elif signature == "2.11":

        def varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
        ):
            return attend(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size, False)

    else:

        def varlen_attn(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            *,
            return_aux=None,
            scale=None,
            window_size=(-1, -1),
            enable_gqa=False,
        ):
            return attend(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size, enable_gqa)

    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


@pytest.mark.parametrize("signature", ["2.10", "2.11", "2.12"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kv_heads, v_dim", [(2, 8), (4, 8), (2, 6)])
def test_the_flash_call_computes_the_per_sequence_attention(signature, window, kv_heads, v_dim):
    """The CUDA path as each torch release's signature takes it (grouped-query heads expanded
    where it has no `enable_gqa`, the window as (w - 1, 0), a scale the kernel lacks folded into
    the queries, narrower value heads padded) against the per-sequence SDPA body."""
    if signature == "2.10" and window is not None:
        pytest.skip("2.10 has no window: the per-sequence body serves windowed layers there")
    fake = _fake_varlen_attn(signature)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9]
    t = sum(lengths)
    q = torch.randn(t, 4, 8, generator=g)
    k = torch.randn(t, kv_heads, 8, generator=g)
    v = torch.randn(t, kv_heads, v_dim, generator=g)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    scale = 0.3
    want = varlen._per_sequence(q, k, v, cu, scale, window)
    orig = varlen._kernel
    varlen._kernel = lambda: fake
    try:
        got = varlen._flash(q, k, v, cu, max(lengths), scale, window)
    finally:
        varlen._kernel = orig
    assert got.shape == want.shape == (t, 4, v_dim)
    assert torch.allclose(got, want, atol=1e-6)


def test_flash_runs_only_where_the_kernel_can():
    cpu = torch.device("cpu")
    assert not varlen.flash_runs(cpu, torch.bfloat16, 64)
    assert varlen.kernel_name(cpu, torch.float32, 64) == "SDPA per sequence"
    cuda = torch.device("cuda", 0)
    assert not varlen.flash_runs(cuda, torch.float32, 64)  # FlashAttention-2 has no fp32
    assert not varlen.flash_runs(cuda, torch.bfloat16, 512)  # nor head dims over 256


def test_under_autocast_the_kernel_gets_the_autocast_dtype(monkeypatch):
    """Under bf16 autocast RoPE leaves q and k in float32 (the residual stream's cos/sin) beside a
    bf16 v; the varlen attention casts all three as autocast casts SDPA's inputs, so that on CUDA
    the bf16 FlashAttention kernel runs (not the per-sequence fallback), and the log-probs are
    padded's within bf16 rounding."""
    seen = []
    real = varlen._per_sequence
    monkeypatch.setattr(
        varlen,
        "_per_sequence",
        lambda q, k, v, *a: seen.append({q.dtype, k.dtype, v.dtype}) or real(q, k, v, *a),
    )
    seqs, lens = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]], [3, 2]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = response_logprobs(_MODEL, seqs, lens, layout="varlen").logprobs
        want = response_logprobs(_MODEL, seqs, lens, layout="padded").logprobs
    assert seen and all(s == {torch.bfloat16} for s in seen)
    assert float((got - want).abs().max()) < 2e-2
