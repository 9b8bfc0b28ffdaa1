"""On CUDA: the `varlen` layout runs torch's FlashAttention-2 (`varlen_attn`) and gives the padded
layout's log-probs and gradients within bf16 rounding (and exactly the per-sequence body's in
float32); `train.fuse` (Liger's kernels, regional compile) gives eager's log-probs and gradients
within bf16 rounding. Each test says what it skips and why."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from weir.config import build_config
from weir.config.devices import rounding_tolerance
from weir.train import fuse, varlen
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.packing import response_logprobs, varlen_supported

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
BF16 = rounding_tolerance(torch.bfloat16)  # mean nats/token between two exact bf16 forwards


def _batch(vocab: int, seed: int = 0):
    """6 prompts of 8-120 tokens, 4 responses each of 1-300 tokens (a spread as RL gives)."""
    rnd = random.Random(seed)
    seqs, lens = [], []
    for _ in range(6):
        prompt = [rnd.randrange(vocab) for _ in range(rnd.randint(8, 120))]
        for _ in range(4):
            n = rnd.randint(1, 300)
            seqs.append(prompt + [rnd.randrange(vocab) for _ in range(n)])
            lens.append(n)
    return seqs, lens


def _run(model, layout: str, seqs, lens, dtype: torch.dtype, routes=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = response_logprobs(model, seqs, lens, layout=layout, with_entropy=True, routes=routes)
    out.logprobs.sum().backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return out.logprobs.detach().float(), grads


def _compare(a, b, lens, grads_a, grads_b, tol: float, grad_rel: float):
    mask = (
        torch.arange(a.shape[1], device=a.device)[None]
        < torch.tensor(lens, device=a.device)[:, None]
    )
    diff = (a - b).abs()[mask]
    assert float(diff.mean()) < tol, float(diff.mean())
    assert float(diff.max()) < 50 * tol, float(diff.max())
    rel = float((grads_a - grads_b).norm() / grads_b.norm())
    assert rel < grad_rel, rel


def _need_flash(head_dim: int) -> None:
    if varlen._kernel() is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10+)")
    if not varlen.flash_runs(CUDA, torch.bfloat16, head_dim):
        pytest.skip("FlashAttention-2 needs sm80 or later")


def test_varlen_runs_flash_attention_and_equals_padded_in_bf16(tiny_model_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA).eval()
    _need_flash(model.config.head_dim)
    calls = {"flash": 0}
    real = varlen._flash
    monkeypatch.setattr(
        varlen,
        "_flash",
        lambda *a, **k: calls.__setitem__("flash", calls["flash"] + 1) or real(*a, **k),
    )
    seqs, lens = _batch(model.config.vocab_size)
    got, g_got = _run(model, "varlen", seqs, lens, torch.bfloat16)
    assert calls["flash"] == model.config.num_hidden_layers  # one kernel call per layer
    want, g_want = _run(model, "padded", seqs, lens, torch.bfloat16)
    _compare(got, want, lens, g_got, g_want, BF16, 0.05)
    print("varlen_attn parameters:", sorted(varlen._kernel()[1]))


def test_varlen_in_float32_on_cuda_is_the_per_sequence_body_and_exact(tiny_model_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA).eval()
    assert not varlen.flash_runs(CUDA, torch.float32, model.config.head_dim)
    seqs, lens = _batch(model.config.vocab_size, seed=1)
    got, g_got = _run(model, "varlen", seqs, lens, torch.float32)
    want, g_want = _run(model, "padded", seqs, lens, torch.float32)
    _compare(got, want, lens, g_got, g_want, 1e-4, 1e-3)


def _padded_routing(model, seqs, lens, dtype: torch.dtype):
    """The experts the padded layout's forward picks for each sequence (an MoE model), as `Routes`
    to replay in another layout's forward; None for a dense model."""
    from weir.data.moe_routing import ROUTERS, Routes, install_routing, recording

    if model.config.model_type not in ROUTERS:
        return None
    spec = install_routing(model)
    width = max(len(s) for s in seqs)
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype), recording(spec) as rec:
        response_logprobs(model, seqs, lens, layout="padded")
    picks = rec.stacked(len(seqs), width)  # left-padded rows
    return Routes([picks[i, width - len(s) :] for i, s in enumerate(seqs)], spec.layers, spec.top_k)


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma3", "deepseek_v3"])
def test_varlen_flash_keeps_windows_and_value_heads_on_real_architectures(tmp_path, name):
    """Sliding windows through the kernel's `window_size` (torch 2.11+), MLA's narrower value
    heads padded: bf16 log-probs within rounding of padded.

    DeepSeek-V3 is a mixture of experts: where two experts' router scores nearly tie, the rounding
    by which two exact bf16 forwards differ flips a token's pick, and that token's log-prob moves
    by up to a nat (seen on an H200: mean within rounding, max 1.07; on a CPU bf16 against float32
    moves 27 of 5286 tokens' picks, max 0.97 nats, and 0.019 with the picks replayed). The varlen
    forward replays the padded forward's picks, so that what is compared is the attention."""
    from weir.tasks.tiny_archs import build_arch_model

    model = AutoModelForCausalLM.from_pretrained(build_arch_model(tmp_path / name, name))
    model = model.to(CUDA).eval()
    _need_flash(64)
    assert varlen_supported(model, torch.bfloat16)[0]
    seqs, lens = _batch(model.config.vocab_size, seed=2)
    routes = _padded_routing(model, seqs, lens, torch.bfloat16)
    got, g_got = _run(model, "varlen", seqs, lens, torch.bfloat16, routes=routes)
    want, g_want = _run(model, "padded", seqs, lens, torch.bfloat16)
    _compare(got, want, lens, g_got, g_want, BF16, 0.05)


def test_an_actor_step_in_varlen_trains_as_padded_on_cuda(tiny_model_dir):
    grads = {}
    for packing in ("varlen", "padded"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA)
        cfg = build_config(
            {},
            ["rollout.batch_prompts=2", "rollout.n=4", f"train.packing={packing}"],
        )
        actor = Actor(model, ActorSettings.from_config(cfg))
        actor.train(make_batch(toy_groups(), version=0))
        grads[packing] = torch.cat([p.grad.flatten() for p in actor.model.parameters()])
    rel = (grads["varlen"] - grads["padded"]).norm() / grads["padded"].norm()
    assert float(rel) < 0.05


def _fused_against_eager(tiny_model_dir, route: str):
    """Log-probs and gradients of the tiny model fused by `route` against the same weights eager,
    bf16 autocast on float32 weights as the trainer runs."""
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA).eval()
    seqs, lens = _batch(eager.config.vocab_size, seed=3)
    want, g_want = _run(eager, "padded", seqs, lens, torch.bfloat16)
    fused = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA).eval()
    got_route = fuse.apply_fusion(route, fused, CUDA)
    if got_route.route != route:
        pytest.skip(f"train.fuse={route} fell back: {got_route.reason}")
    for layout in ("padded", "varlen"):
        got, g_got = _run(fused, layout, seqs, lens, torch.bfloat16)
        _compare(got, want, lens, g_got, g_want, BF16, 0.05)


def test_liger_kernels_give_eager_logprobs_and_gradients(tiny_model_dir):
    from transformers.models.qwen3 import modeling_qwen3

    saved = dict(vars(modeling_qwen3))  # Liger patches the modeling module: put it back after
    try:
        _fused_against_eager(tiny_model_dir, "liger")
    finally:
        for key, value in saved.items():
            setattr(modeling_qwen3, key, value)


def test_liger_fuses_the_trainers_modules_and_nothing_else(tiny_model_dir):
    """After `train.fuse=liger` the modeling module is as it was (Liger's process-wide classes and
    RoPE put back), a model built afterwards is plain, and an engine's copy of the fused model runs
    the plain modules again (its direct decode forward accepts it)."""
    import copy

    from transformers.models.qwen3 import modeling_qwen3

    from weir.engine.decode import DecodeForward
    from weir.train.liger_scope import strip_liger

    fused = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA)
    saved = dict(vars(modeling_qwen3))
    try:
        got = fuse.apply_fusion("liger", fused, CUDA)
        if got.route != "liger":
            pytest.skip(f"train.fuse=liger fell back: {got.reason}")
        assert vars(modeling_qwen3) == saved
        assert any("forward" in vars(m) for m in fused.modules())
        later = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA).eval()
        assert DecodeForward.build(later, per_layer_type=False) is not None
        engine = copy.deepcopy(fused).to(torch.bfloat16).eval()
        assert DecodeForward.build(engine, per_layer_type=False) is None
        assert strip_liger(engine) > 0
        assert DecodeForward.build(engine, per_layer_type=False) is not None
    finally:
        for key, value in saved.items():
            setattr(modeling_qwen3, key, value)


def test_compiled_layers_give_eager_logprobs_and_gradients(tiny_model_dir):
    _fused_against_eager(tiny_model_dir, "compile")
