"""The fused log-prob + entropy pass on CUDA, eager, torch.compile'd and as the hand-written Triton
kernels, against the reference functions on the same bfloat16 logits: values within 1e-4 nats
(both accumulate in float32 over a 32k vocabulary, in other orders), gradients within one bfloat16
rounding of the exact gradient (the reference within its three).
The compiled and Triton kernels need Triton and a C compiler; where they are missing their tests
skip, saying why (`compile_status`, `triton_status`). A compiled or Triton kernel that fails at
run time falls back to the eager chunks, whose answers would pass these tests: the `checked`
fixture fails a test after which either fell back, and counts the Triton launches."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.head_rounding import NON_FINITE_ROWS, excess, make_non_finite
from tests.toy import toy_groups
from weir.algo import entropy as E
from weir.algo import (
    entropy_from_logits,
    logprob_triton,
    logprobs_from_logits,
    token_logprobs_and_entropy,
)
from weir.algo.entropy import compile_status
from weir.algo.logprob_triton import triton_status
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
KERNELS = ["eager", "compiled", "triton"]
STATUS = {"compiled": compile_status, "triton": triton_status}


def _needs(kernel: str) -> None:
    status = STATUS[kernel](CUDA) if kernel in STATUS else "available"
    if status != "available":
        pytest.skip(f"{kernel} kernel: {status}")


@pytest.fixture
def checked(monkeypatch):
    """No kernel failure before the test (the fallback lasts a process) nor during it; the
    Triton launches counted (a test of the Triton kernel must have run it)."""
    monkeypatch.setattr(E, "_triton_failure", [])
    monkeypatch.setattr(E, "_compile_failure", [])
    calls = {"stats": 0, "grad": 0}
    for name in ("stats", "grad"):
        real = getattr(logprob_triton, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(logprob_triton, name, counted)
    yield calls
    assert not E._triton_failure, E._triton_failure
    assert not E._compile_failure, E._compile_failure


def _launched(kernel: str, calls: dict[str, int]) -> None:
    if kernel == "triton":
        assert calls["stats"] >= 1 and calls["grad"] >= 1, calls


def _logits(n=4096, v=32768, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    x = (torch.randn(n, v, generator=g, device=CUDA) * 3).to(torch.bfloat16)
    x[:, 7] = float("-inf")
    ids = torch.randint(10, v, (n,), generator=g, device=CUDA)
    w = torch.randn(2, n, generator=g, device=CUDA)
    return x, ids, w


def _run(kernel, base, ids, w, t, entropy):
    x = base.clone().requires_grad_(True)
    if kernel == "reference":
        lp = logprobs_from_logits(x, ids, 256, temperature=t)
        h = entropy_from_logits(x if entropy == "grad" else x.detach(), 256, temperature=t)
    else:
        lp, h = token_logprobs_and_entropy(
            x, ids, 256, temperature=t, entropy=entropy, kernel=kernel
        )
    loss = (lp * w[0]).sum() + ((h * w[1]).sum() if entropy == "grad" else 0.0)
    loss.backward()
    torch.cuda.synchronize()
    return lp.detach(), h.detach(), x.grad


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("t", [1.0, 0.6])
@pytest.mark.parametrize("entropy", ["value", "grad"])
def test_fused_head_equals_the_reference_in_bfloat16(kernel, t, entropy, checked):
    _needs(kernel)
    base, ids, w = _logits()
    got = _run(kernel, base, ids, w, t, entropy)
    _launched(kernel, checked)
    want = _run("reference", base, ids, w, t, entropy)
    assert got[2].dtype == torch.bfloat16 and torch.isfinite(got[2].float()).all()
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=0)
    # against the exact (float64) gradient: the fused head's within one bf16 rounding, the
    # reference's within its three (it rounds its two terms apart and adds them in bf16; where
    # they cancel that is far more than a relative tolerance on the result allows: the first GPU
    # run saw 0.008% of the elements off by up to 0.0078); tests/head_rounding.py
    r = excess({"got": got[2], "reference": want[2]}, base, ids, w, t, entropy == "grad")
    assert r["got"]["one"] <= 1.0, r
    assert r["reference"]["three"] <= 1.0, r
    assert r["got"]["mean"] <= r["reference"]["mean"] * (1 + 1e-6), r
    assert (got[2][:, 7] == 0).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("v", [151936, 50257])
def test_real_vocabularies_and_non_finite_rows(kernel, v, checked):
    """Qwen2.5's 151,936 columns (the last block of each kernel partial: the compiler splits a
    masked and an unmasked load there) and GPT-2's 50,257 (odd: unaligned rows, scalar loads,
    masked tails), with the non-finite rows of the interpreter's cases (tests/algo/triton_cases.py;
    on a GPU `max` drops a NaN, where NumPy keeps it): log-probs and entropy as the reference's
    (within 1e-4 on finite rows, NaN and -inf in the same places), gradients within one bf16
    rounding of the exact one on finite rows and NaN where the eager chunks' are."""
    _needs(kernel)
    base, ids, w = _logits(n=1024, v=v, seed=2)
    make_non_finite(base, ids)
    t = 0.7

    def fused(k):
        x = base.clone().requires_grad_(True)
        lp, h = token_logprobs_and_entropy(x, ids, 256, temperature=t, entropy="grad", kernel=k)
        ((lp * w[0]).sum() + (h * w[1]).sum()).backward()
        torch.cuda.synchronize()
        return lp.detach(), h.detach(), x.grad

    got = fused(kernel)
    _launched(kernel, checked)
    eager = fused("eager")
    ref_lp = logprobs_from_logits(base, ids, 256, temperature=t, allow_nonfinite=True)
    ref_h = entropy_from_logits(base, 256, temperature=t, allow_nonfinite=True)
    for mine, ref in ((got[0], ref_lp), (got[1], ref_h)):
        assert torch.equal(mine.isnan(), ref.isnan()), (mine[:8], ref[:8])
    assert got[0][2] == got[0][6] == float("-inf") and got[0][[1, 3, 4]].isnan().all()
    assert torch.equal(got[2].isnan(), eager[2].isnan())
    finite = torch.ones(base.shape[0], dtype=torch.bool, device=CUDA)
    finite[list(NON_FINITE_ROWS)] = False
    torch.testing.assert_close(got[0][finite], ref_lp[finite], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1][finite], ref_h[finite], atol=1e-4, rtol=0)
    r = excess({"got": got[2][finite]}, base[finite], ids[finite], w[:, finite], t, True)
    assert r["got"]["one"] <= 1.0, r


def test_the_fast_kernels_are_faster_and_leaner_than_the_reference(checked):
    """16k x 151,936 bf16 logits (the Qwen2.5 vocabulary; row x V passes 2^31), forward and
    backward, entropy as a metric: times and peaks written to GPU_CHECK_OUT; the compiled and the
    Triton kernels (those there are) must not be slower, and must have run (no fallback) to the
    reference's values."""
    fast = [k for k, status in STATUS.items() if status(CUDA) == "available"]
    if not fast:
        pytest.skip(f"compiled kernel: {compile_status(CUDA)}; triton: {triton_status(CUDA)}")
    base, ids, w = _logits(n=16384, v=151936, seed=1)
    out: dict[str, dict[str, float]] = {}
    values: dict[str, tuple] = {}
    for kernel in ("reference", "eager", *fast) * 2:
        first = _run(kernel, base, ids, w, 1.0, "value")  # warm-up (the compile, on the first)
        values.setdefault(kernel, first[:2])
        torch.cuda.reset_peak_memory_stats(CUDA)
        t0 = time.perf_counter()
        _run(kernel, base, ids, w, 1.0, "value")
        s = time.perf_counter() - t0
        row = out.setdefault(kernel, {"s": float("inf")})
        row["s"] = min(row["s"], s)
        row["peak_gb"] = torch.cuda.max_memory_allocated(CUDA) / 2**30
    where = os.environ.get("GPU_CHECK_OUT")
    if where:
        Path(where, "fused_head.json").write_text(json.dumps(out, indent=1))
    print("fused head:", out)
    for kernel in ("eager", *fast):  # what was timed computed the reference's values
        torch.testing.assert_close(values[kernel][0], values["reference"][0], atol=1e-4, rtol=0)
        torch.testing.assert_close(values[kernel][1], values["reference"][1], atol=1e-4, rtol=0)
    for kernel in fast:
        assert out[kernel]["s"] <= out["reference"]["s"], kernel
        assert out[kernel]["peak_gb"] <= out["reference"]["peak_gb"], kernel


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_training_step_with_the_fused_head_matches_the_reference(tiny_model_dir, kernel, checked):
    _needs(kernel)
    grads, stats = [], []
    for k in (kernel, "reference"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA)
        cfg = build_config(
            {},
            [
                "rollout.batch_prompts=2",
                "rollout.n=4",
                "train.compute_dtype=bfloat16",
                f"train.logprob_kernel={k}",
                "algo.entropy_coef=0.01",
            ],
        )
        actor = Actor(model, ActorSettings.from_config(cfg))
        stats.append(actor.train(make_batch(toy_groups(), version=0)))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    _launched(kernel, checked)
    assert abs(stats[0]["train/entropy"] - stats[1]["train/entropy"]) < 1e-3
    torch.testing.assert_close(grads[0], grads[1], atol=3e-2, rtol=3e-2)
