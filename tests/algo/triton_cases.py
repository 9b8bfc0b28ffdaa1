"""`token_logprobs_and_entropy(..., kernel="triton")` (`weir.algo.logprob_triton`) in Triton's
interpreter (TRITON_INTERPRET=1: the kernels run on CPU tensors) against the reference functions
(`logprobs_from_logits`, `entropy_from_logits`) and the eager chunks: values and gradients in
float32 (within 1e-5 absolute, 1e-6 relative), bfloat16 gradients within one bf16 rounding of the
exact gradient, temperatures, entropy modes, row slices, vocabularies that are not a multiple of
the block or smaller than it, non-finite logits (the same NaN / inf as the reference), float64
routed to the chunks, a GPU failure contained, and `train.logprob_kernel=triton` refused where
the kernels cannot run. The kernels on a GPU: tests/gpu/test_fused_head_gpu.py.

Not collected by itself: tests/algo/test_logprob_triton.py runs this file in a fresh process with
TRITON_INTERPRET=1 (Triton decides when its language is first imported whether its functions are
interpreted, and in a test worker another test's torch.compile may have imported it already)."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.head_rounding import make_non_finite
from weir.algo import entropy as E
from weir.algo import entropy_from_logits, logprob_triton, logprobs_from_logits
from weir.algo import token_logprobs_and_entropy as fused

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # interpreter
TOL = {"atol": 1e-5, "rtol": 1e-6}  # float32 logits: another summation order, that is all


@pytest.fixture
def interpret(monkeypatch):
    """The interpreter on, no earlier failure, and a count of the kernel launches (so that a test
    cannot pass on the chunks' answer)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (pip install 'weir[dev]'): its interpreter runs these")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(E, "_triton_failure", [])
    calls = {"stats": 0, "grad": 0}
    for name in ("stats", "grad"):
        real = getattr(logprob_triton, name)

        def counted(x, *a, _real=real, _name=name, **k):
            calls[_name] += 1
            calls["row_stride"] = x.stride(0)
            return _real(x, *a, **k)

        monkeypatch.setattr(logprob_triton, name, counted)
    return calls


@pytest.fixture(params=[16, 8192], ids=["16-column-blocks", "8192-column-blocks"])
def block(request, monkeypatch):
    """Blocks of 16 columns (V = 50: four steps, the last partial; the maximum grows across
    them) and the default of 8192 (a block larger than V)."""
    monkeypatch.setattr(logprob_triton, "FWD_BLOCK_V", request.param)
    monkeypatch.setattr(logprob_triton, "BWD_BLOCK_V", min(request.param, 4096))
    return request.param


def logits(n=9, v=50, dtype=torch.float32, seed=0, scale=3.0):
    """Random logits, a column at -inf and a row with ten -inf logits (no target at -inf)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    x[:, 3] = float("-inf")
    x[min(5, n - 1), :10] = float("-inf")
    return x, torch.randint(10, v, (n,), generator=g)


def run(kernel, base, ids, t=1.0, entropy="grad", w=None, view=lambda x: x):
    """(log-probs, entropy, gradient of sum(w0 logp + w1 H) as far as `entropy` trains it)."""
    n = ids.numel()
    w = torch.randn(2, n, generator=torch.Generator().manual_seed(9)) if w is None else w
    leaf = base.detach().clone().requires_grad_(True)
    x = view(leaf)
    if kernel == "reference":
        lp = logprobs_from_logits(x, ids, temperature=t, allow_nonfinite=True)
        src = x if entropy == "grad" else x.detach()
        h = entropy_from_logits(src, temperature=t, allow_nonfinite=True)
    else:
        lp, h = fused(x, ids, 4, temperature=t, entropy=entropy, kernel=kernel)
    loss = (lp * w[0].reshape(lp.shape)).sum()
    if entropy == "grad":
        loss = loss + (h * w[1].reshape(h.shape)).sum()
    loss.backward()
    return lp.detach(), None if h is None else h.detach(), leaf.grad


def close(got, want, **tol):
    for a, b in zip(got, want, strict=True):
        if a is None or b is None:
            assert a is b is None
        else:
            torch.testing.assert_close(a, b, equal_nan=True, **(tol or TOL))


@pytest.mark.parametrize("t", [1.0, 0.7])
@pytest.mark.parametrize("entropy", ["none", "value", "grad"])
def test_float32_equals_the_reference_and_the_eager_chunks(interpret, block, t, entropy):
    base, ids = logits()
    got = run("triton", base, ids, t, entropy)
    assert interpret["stats"] == interpret["grad"] == 1
    want = run("reference", base, ids, t, "grad" if entropy == "grad" else "value")
    close(got[0::2], want[0::2])
    if entropy != "none":
        close(got[1:2], want[1:2])
    close(got, run("eager", base, ids, t, entropy))
    assert (got[2][:, 3] == 0).all() and (got[2][5, :10] == 0).all()  # -inf: no gradient


def test_entropy_modes_and_autograd(interpret):
    base, ids = logits()
    x = base.clone().requires_grad_(True)
    lp, h = fused(x, ids, entropy="value", kernel="triton")
    assert lp.requires_grad and not h.requires_grad  # a metric: no graph
    assert fused(x, ids, entropy="none", kernel="triton")[1] is None
    _, h = fused(x, ids, entropy="grad", kernel="triton")
    h.sum().backward()  # the entropy alone: no gradient for the log-probs (g_logp None)
    y = base.clone().requires_grad_(True)
    entropy_from_logits(y).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, **TOL)
    lp, h = fused(torch.empty(0, 50), ids[:0], kernel="triton")  # no rows: no launch
    assert lp.shape == h.shape == (0,)


def test_bfloat16_gradient_is_the_exact_one_rounded_once(interpret):
    """64 x 4096 bf16 logits, the entropy trained, T = 0.6: values within 1e-5 of the reference
    (both read the same bf16 logits in float32), the gradient bf16 and within one bf16 rounding of
    the exact (float64) gradient everywhere (tests/head_rounding.py)."""
    from tests.head_rounding import excess

    base, ids = logits(64, 4096, torch.bfloat16, seed=3)
    w = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    got = run("triton", base, ids, 0.6, "grad", w)
    want = run("reference", base, ids, 0.6, "grad", w)
    assert got[2].dtype == torch.bfloat16 and got[0].dtype == got[1].dtype == torch.float32
    close(got[:2], want[:2])
    r = excess({"triton": got[2]}, base, ids, w, 0.6, entropy_trained=True)
    assert r["triton"]["one"] <= 1.0, r


def test_float16_logits(interpret):
    base, ids = logits(dtype=torch.float16)
    got, want = run("triton", base, ids, 0.8), run("eager", base, ids, 0.8)
    assert got[2].dtype == torch.float16
    close(got[:2], want[:2])
    close(got[2:], want[2:], atol=1e-3, rtol=1e-3)  # float16: within one rounding of each other


@pytest.mark.parametrize("layout", ["row-slice", "column-stride", "leading-shape"])
def test_strided_logits(interpret, block, layout):
    """Columns 2..51 of 57: a row slice reaches the kernels as it is (row stride 57); logits with
    strided columns are copied first; a leading shape is flattened."""
    wide, _ = logits(9, 57)
    ids = torch.randint(10, 50, (9,), generator=torch.Generator().manual_seed(5))
    view = lambda x: x[:, 2:52]  # noqa: E731
    if layout == "column-stride":
        wide, view = wide.t().contiguous(), lambda x: x.t()[:, 2:52]
    if layout == "leading-shape":
        ids, view = ids.reshape(3, 3), lambda x: x[:, 2:52].reshape(3, 3, 50)
    got = run("triton", wide, ids, 0.9, view=view)
    close(got, run("reference", wide, ids, 0.9, view=view))
    close(got, run("eager", wide, ids, 0.9, view=view))
    if layout == "row-slice":
        assert interpret["row_stride"] == 57  # no copy on the way


def test_non_finite_logits_give_what_the_reference_gives(interpret, block):
    """-inf entries, a row all -inf, a +inf entry (in the second block of 16: the maximum turns
    infinite mid-row), a NaN entry, a -inf at the token, a block all -inf before a maximum of
    -200 / T (no rescaling of nothing by exp(285)): the values are those of the reference
    (NaN, +-inf in the same places); the gradient is the eager chunks' (NaN rows alike; the
    reference's entropy gradient is NaN across a row with +inf, the fused one 0 where p = 0)."""
    base, ids = logits(8, 50)
    make_non_finite(base, ids)
    base[7, :16] = float("-inf")  # a first block all -inf, then logits near -200: finite
    base[7, 16:] -= 200.0
    ids[7] = 30
    for entropy in ("value", "grad"):
        got = run("triton", base, ids, 0.7, entropy)
        ref = run("reference", base, ids, 0.7, entropy)
        eager = run("eager", base, ids, 0.7, entropy)
        for a, b in ((got[:2], ref[:2]), (got, eager)):
            close([x[:7] for x in a], [x[:7] for x in b])
            # row 7: |z| ~ 285, where float32 resolves 3e-5 (its logits / T round apart)
            close([x[7:] for x in a], [x[7:] for x in b], atol=1e-4, rtol=0)
        for k in (0, 1):
            assert torch.equal(got[k].isnan(), ref[k].isnan()) and got[k][[1, 3]].isnan().all()
        assert got[0][2] == got[0][6] == float("-inf")
        assert torch.isfinite(got[0][7]) and torch.isfinite(got[2][[0, 5, 7]]).all()


def test_float64_runs_the_chunks(interpret):
    base, ids = logits(dtype=torch.float64)
    got = run("triton", base, ids, 0.7)
    assert interpret["stats"] == interpret["grad"] == 0
    close(got, run("eager", base, ids, 0.7), atol=0, rtol=0)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(1, 6),
    v=st.integers(1, 40),
    blk=st.sampled_from([16, 32]),
    t=st.floats(0.3, 3.0),
    seed=st.integers(0, 2**16),
)
def test_property_equals_the_reference(interpret, monkeypatch, n, v, blk, t, seed):
    monkeypatch.setattr(logprob_triton, "FWD_BLOCK_V", blk)
    monkeypatch.setattr(logprob_triton, "BWD_BLOCK_V", blk)
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, v, generator=g) * 4
    ids = torch.randint(0, v, (n,), generator=g)
    got = run("triton", base, ids, t)
    close(got, run("reference", base, ids, t))
    assert (
        float(got[1].min()) >= -1e-5 and float(got[1].max()) <= float(torch.tensor(v).log()) + 1e-5
    )


def test_a_failure_outside_the_interpreter_is_contained(monkeypatch, caplog):
    """On a GPU a Triton compile or launch error is logged once; that call and every later one run
    the chunks (forward and backward apart: a forward that ran may leave a backward that fails)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(E, "_triton_failure", [])
    monkeypatch.setattr(logprob_triton, "triton_status", lambda device: "available")
    base, ids = logits()
    want = run("eager", base, ids, 0.7)

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly failed")

    stand_in = E._chunked_stats  # the forward "runs", its backward fails
    monkeypatch.setattr(logprob_triton, "stats", lambda x, i, t, h: stand_in(x, i, 4, t, h, False))
    monkeypatch.setattr(logprob_triton, "grad", broken)
    with caplog.at_level(logging.WARNING, logger=E.__name__):
        close(run("triton", base, ids, 0.7), want, atol=0, rtol=0)
        monkeypatch.setattr(logprob_triton, "stats", broken)
        close(run("triton", base, ids, 0.7), want, atol=0, rtol=0)
    assert E._triton_failure == ["RuntimeError: PTX assembly failed"]
    assert len([r for r in caplog.records if "Triton" in r.getMessage()]) == 1
    monkeypatch.setattr(E, "_triton_failure", [])  # the forward's own failure, contained too
    close(run("triton", base, ids, 0.7), want, atol=0, rtol=0)
    assert len(E._triton_failure) == 1


def test_triton_is_refused_where_it_cannot_run(monkeypatch):
    """Without TRITON_INTERPRET a CPU tensor cannot take the kernels: `kernel="triton"` and
    `train.logprob_kernel=triton` are refused, in one line that says why."""
    from weir.config import build_config
    from weir.train.response_rows import check_kernel

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert logprob_triton.triton_status("cpu") != "available"
    x, ids = logits()
    with pytest.raises(ValueError, match=r"kernel='triton': .*'auto'"):
        fused(x, ids, kernel="triton")
    cfg = build_config({}, ["train.logprob_kernel=triton", "train.device=cpu"])
    with pytest.raises(ValueError, match=r"train\.logprob_kernel=triton on cpu: .*auto") as err:
        check_kernel(cfg.train.logprob_kernel, torch.device("cpu"))
    assert "\n" not in str(err.value)
    check_kernel("eager", torch.device("cpu"))  # the others are not its business


def test_the_gpu_benchmarks_block_sweep_times_every_block(interpret):
    """benchmarks/gpu_timing.triton_block_sweep, the GPU check's tuning of the block sizes, runs
    the forward and the backward at every block it lists (here in the interpreter, on so few
    columns that each block covers the row: the path, not the timings)."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[2] / "benchmarks")
    sys.path.insert(0, bench)
    try:
        import gpu_timing
    finally:
        sys.path.remove(bench)
    x, ids = logits(n=4, v=40)
    out = gpu_timing.triton_block_sweep(x, ids, torch.device("cpu"), repeat=1)
    assert out["defaults"] == [[8192, 16], [4096, 8]]
    for name, configs in (
        ("forward", gpu_timing.FWD_CONFIGS),
        ("backward", gpu_timing.BWD_CONFIGS),
    ):
        assert set(out[name]) == {f"{b}x{w}" for b, w in configs}
        for row in out[name].values():
            assert row["ms"] > 0 and row["gb_s"] > 0, row
    assert interpret["stats"] >= 2 * len(gpu_timing.FWD_CONFIGS)  # a compile run, then timed
    assert interpret["grad"] >= 2 * len(gpu_timing.BWD_CONFIGS)
