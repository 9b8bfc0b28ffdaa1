"""The fused log-prob + entropy pass (`token_logprobs_and_entropy`) against the reference functions
(`logprobs_from_logits`, `entropy_from_logits`): values and gradients, temperatures, -inf logits,
chunk edges, each entropy mode, lower peak memory, and its chunk functions traceable whole by
torch.compile (the compiled kernel itself needs CUDA: tests/gpu/test_fused_head_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.memory_probe import AllocationPeak
from weir.algo import entropy as E
from weir.algo import entropy_from_logits, logprobs_from_logits, token_logprobs_and_entropy


def logits_with_inf(n: int, v: int, dtype=torch.float32, seed: int = 0, scale: float = 3.0):
    """Random logits with a column at -inf and a row with its first ten logits at -inf (targets
    are drawn from 10.. so no target is at -inf)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    x[:, 3] = float("-inf")
    x[min(5, n - 1), :10] = float("-inf")
    ids = torch.randint(10, v, (n,), generator=g)
    return x, ids


def fused(x, ids, chunk, t, entropy="grad"):
    return token_logprobs_and_entropy(x, ids, chunk, temperature=t, entropy=entropy, kernel="eager")


def reference(x, ids, chunk, t):
    return logprobs_from_logits(x, ids, chunk, temperature=t), entropy_from_logits(
        x, chunk, temperature=t
    )


def values_and_grad(fn, base, ids, chunk, t, w1, w2):
    x = base.detach().clone().requires_grad_(True)
    lp, h = fn(x, ids, chunk, t)
    ((lp * w1) + (h * w2)).sum().backward()
    return lp.detach(), h.detach(), x.grad


@pytest.mark.parametrize("chunk", [1, 5, 37, 64])
@pytest.mark.parametrize("t", [1.0, 0.7, 1.3])
def test_equals_the_reference_in_float64(chunk, t):
    base, ids = logits_with_inf(37, 50, torch.float64)
    w = torch.randn(2, 37, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = values_and_grad(fused, base, ids, chunk, t, *w)
    want = values_and_grad(reference, base, ids, chunk, t, *w)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert torch.isfinite(got[2]).all() and (got[2][:, 3] == 0).all()  # -inf: no gradient


@pytest.mark.parametrize("t", [1.0, 0.7, 1.3, 0.3])
def test_float32_is_the_reference_up_to_rounding(t):
    """float32 over a 1000-token vocabulary: within 4e-6 x the values' scale of the reference
    (a few float32 ulps: the chunked sums round in another order, and how many ulps that costs
    depends on the CPU's kernels; an AVX2 EPYC put 2.5 ulps between them at T = 1, beyond the
    absolute 1e-6 once asked there), and no further from the float64 result than the reference
    itself."""
    base, ids = logits_with_inf(64, 1000, torch.float64, seed=2)
    w = torch.randn(2, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    truth = values_and_grad(reference, base, ids, 64, t, *w)
    w32 = [x.float() for x in w]
    got = values_and_grad(fused, base.float(), ids, 7, t, *w32)
    want = values_and_grad(reference, base.float(), ids, 7, t, *w32)
    for a, b, exact in zip(got, want, truth, strict=True):
        scale = max(1.0, float(b.abs().max()))
        assert float((a - b).abs().max()) <= 4e-6 * scale
        ours = float((a.double() - exact).abs().max())
        theirs = float((b.double() - exact).abs().max())
        assert ours <= 2 * theirs + 1e-7, (ours, theirs)


def test_entropy_modes():
    base, ids = logits_with_inf(9, 40)
    x = base.clone().requires_grad_(True)
    lp, h = fused(x, ids, 4, 1.0, entropy="value")
    assert not h.requires_grad and lp.requires_grad  # a metric: no graph
    lp.sum().backward()
    y = base.clone().requires_grad_(True)
    logprobs_from_logits(y, ids, 4).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(h, entropy_from_logits(base, 4), atol=1e-6, rtol=0)
    lp2, none = fused(base, ids, 4, 1.0, entropy="none")
    assert none is None
    torch.testing.assert_close(lp2, lp.detach(), atol=0, rtol=0)
    z = base.clone().requires_grad_(True)  # the entropy alone may take the gradient
    _, h3 = fused(z, ids, 4, 1.0)
    h3.sum().backward()
    w = base.clone().requires_grad_(True)
    entropy_from_logits(w, 4).sum().backward()
    torch.testing.assert_close(z.grad, w.grad, atol=1e-6, rtol=0)


def test_bfloat16_logits_give_a_bfloat16_gradient_and_float32_values():
    base, ids = logits_with_inf(33, 64, torch.bfloat16)
    got = values_and_grad(fused, base, ids, 8, 1.0, torch.ones(33), torch.ones(33))
    want = values_and_grad(reference, base, ids, 8, 1.0, torch.ones(33), torch.ones(33))
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=2e-6, rtol=0)
    # the reference adds two bf16 gradients, the fused pass rounds their float32 sum once
    torch.testing.assert_close(got[2].float(), want[2].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("t", [1.0, 0.6])
def test_a_bfloat16_gradient_is_the_exact_one_rounded_once(t):
    """256 x 4096 bf16 logits, the entropy trained: the fused gradient is within one bf16
    rounding of the exact (float64) gradient everywhere (tests/head_rounding.py: the bound, and
    why a relative tolerance against the reference cannot hold); the reference, which rounds its
    two terms apart and adds them in bf16, needs its three roundings (seen up to ~100 times one
    rounding where the terms cancel) and is further off on average."""
    from tests.head_rounding import excess

    g = torch.Generator().manual_seed(0)
    base = (torch.randn(256, 4096, generator=g) * 3).to(torch.bfloat16)
    base[:, 7] = float("-inf")
    ids = torch.randint(10, 4096, (256,), generator=g)
    w = torch.randn(2, 256, generator=g)
    got = values_and_grad(fused, base, ids, 64, t, w[0], w[1])[2]
    want = values_and_grad(reference, base, ids, 64, t, w[0], w[1])[2]
    r = excess({"fused": got, "reference": want}, base, ids, w, t, entropy_trained=True)
    assert r["fused"]["one"] <= 1.0, r
    assert r["reference"]["three"] <= 1.0, r
    assert r["reference"]["one"] > 2.0, r  # more than one rounding off somewhere
    assert r["fused"]["mean"] < r["reference"]["mean"], r


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 12),
    v=st.integers(1, 30),
    chunk=st.integers(1, 16),
    t=st.floats(0.2, 3.0),
    seed=st.integers(0, 2**16),
)
def test_property_equals_the_reference(n, v, chunk, t, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, v, generator=g, dtype=torch.float64) * 4
    ids = torch.randint(0, v, (n,), generator=g)
    w = torch.randn(2, n, generator=g, dtype=torch.float64)
    got = values_and_grad(fused, base, ids, chunk, t, *w)
    want = values_and_grad(reference, base, ids, chunk, t, *w)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)
    # the log-probs of a row are a distribution; the entropy lies in [0, log V]
    assert (
        float(got[1].min()) >= -1e-12 and float(got[1].max()) <= torch.log(torch.tensor(v)) + 1e-9
    )


def test_leading_shape_and_bad_input():
    x = torch.randn(2, 3, 5)
    ids = torch.randint(0, 5, (2, 3))
    lp, h = token_logprobs_and_entropy(x, ids, 2, kernel="eager")
    assert lp.shape == h.shape == (2, 3)
    with pytest.raises(ValueError, match="token_ids"):
        token_logprobs_and_entropy(x, ids.float())
    with pytest.raises(ValueError, match="entropy"):
        token_logprobs_and_entropy(x, ids, entropy="yes")
    with pytest.raises(ValueError, match="compiled"):  # no CUDA here
        token_logprobs_and_entropy(x, ids, kernel="compiled")


def test_peak_memory_is_lower_than_the_reference():
    """bf16 logits, 1024 x 4096, forward and backward: one bf16 gradient instead of two (entropy
    trained), and fewer chunk temporaries (measured: 13.1 MB against 25.2 MB with the entropy
    trained, 12.6 MB against 16.8 MB with the entropy as a metric)."""
    n, v, chunk = 1024, 4096, 128
    base, ids = logits_with_inf(n, v, torch.bfloat16)
    w = torch.randn(n)
    peaks = {}
    for name, mode in (
        ("fused", "grad"),
        ("reference", "grad"),
        ("fused", "value"),
        ("reference", "value"),
    ):
        x = base.clone().requires_grad_(True)
        with AllocationPeak() as mem:
            if name == "fused":
                lp, h = fused(x, ids, chunk, 1.0, entropy=mode)
            else:
                lp = logprobs_from_logits(x, ids, chunk, allow_nonfinite=True)
                src = x if mode == "grad" else x.detach()
                h = entropy_from_logits(src, chunk, allow_nonfinite=True)
            loss = (lp * w).sum() + ((h * w).sum() if mode == "grad" else 0.0)
            loss.backward()
        peaks[name, mode] = mem.peak
        assert mem.largest < n * v * 4  # never a full float32 copy
    grad = n * v * 2
    assert peaks["fused", "grad"] <= peaks["reference", "grad"] - grad / 2, peaks
    assert peaks["fused", "value"] <= peaks["reference", "value"], peaks
    # the gradient plus at most three chunk-sized float32 temporaries (the reference: ~2 x 2 + 4)
    assert peaks["fused", "grad"] <= grad + 3 * chunk * v * 4, peaks


@pytest.mark.slow
def test_the_chunk_functions_trace_whole_for_torch_compile():
    """torch.compile with no graph break (fullgraph) and dynamic row counts gives the eager chunk
    functions' numbers; aot_eager traces as Inductor would without generating code (compiling
    that code on a CPU costs minutes, on CUDA it runs in tests/gpu)."""
    fwd = torch.compile(E._stats_chunk, backend="aot_eager", fullgraph=True, dynamic=True)
    bwd = torch.compile(E._grad_chunk, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (13, 7):
        x, ids = logits_with_inf(rows, 50, torch.bfloat16, seed=rows)
        got, want = fwd(x, ids, 0.7, True), E._stats_chunk(x, ids, 0.7, True)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        g = torch.randn(2, rows)
        out = torch.zeros(rows + 4, 50, dtype=torch.bfloat16)
        ref = out.clone()
        # compiled: the token's term by a column comparison; eager: scatter_add_ (the same sum)
        bwd(x, ids, got[0], got[1], got[3], g[0], g[1], 0.7, out[2 : 2 + rows], False)
        E._grad_chunk(x, ids, want[0], want[1], want[3], g[0], g[1], 0.7, ref[2 : 2 + rows], True)
        torch.testing.assert_close(out, ref, atol=0, rtol=0)  # the rows around untouched


@pytest.fixture
def counted_compiles(monkeypatch):
    """`kernel="compiled"` on the CPU through a backend that counts dynamo's graphs and runs them
    as traced (what dynamo guards on, hence when it recompiles, is the same as with Inductor)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    torch._dynamo.reset()
    monkeypatch.setattr(E, "_COMPILE_OPTIONS", {"dynamic": True, "backend": counter})
    monkeypatch.setattr(E, "_compiled", {})
    monkeypatch.setattr(E, "compile_status", lambda device: "available")
    yield counter
    torch._dynamo.reset()


def test_the_compiled_chunks_compile_once_per_branch_whatever_the_lengths(counted_compiles):
    """The calls of a training run: micro-batches of many row counts (last chunks of one row
    among them), a packed (1, T, V) row and padded (b, L, V) rows, under autocast and not, with
    and without gradients. One graph per chunk function and branch (entropy or not; its gradient
    or not), 4 in all, at one temperature (a constant of the graph: another temperature, such
    as a distillation teacher's, compiles once more). On an H200 the calls of a run hit dynamo's
    recompile limit of 8 for the forward chunk (guards on the logits' base shape, on autocast, on
    a size of 1)."""
    for shape in ((1, 40), (4, 9), (1, 37), (2, 8), (1, 1), (3, 33), (1, 2)):
        for autocast in (False, True):
            for grad in (True, False):
                x = torch.randn(*shape[:-1], shape[-1] + 1, 64).to(torch.bfloat16)
                x = x.requires_grad_(grad)[..., :-1, :]  # a view, as the layouts hand it over
                ids = torch.randint(0, 64, x.shape[:-1])
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    lp, h = token_logprobs_and_entropy(x, ids, 16, kernel="compiled")
                if grad:
                    lp.sum().backward()
    assert counted_compiles.frame_count == 2  # forward with entropy, backward without g_H
    base, ids = logits_with_inf(40, 64, torch.bfloat16, seed=1)
    w = torch.randn(2, 40, generator=torch.Generator().manual_seed(1))
    runs = {}
    for kernel in ("compiled", "eager"):
        x = base.clone().requires_grad_(True)
        lp, h = token_logprobs_and_entropy(x, ids, 16, entropy="grad", kernel=kernel)
        ((lp * w[0]) + (h * w[1])).sum().backward()
        runs[kernel] = (lp.detach(), h.detach(), x.grad)
        token_logprobs_and_entropy(base, ids, 16, entropy="none", kernel=kernel)
    assert counted_compiles.frame_count == 4  # the other two branches, once each
    for got, want in zip(runs["compiled"], runs["eager"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
