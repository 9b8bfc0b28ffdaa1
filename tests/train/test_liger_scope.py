"""`train.fuse=liger` fuses the trainer's own modules and nothing else in the process: what Liger
replaces in the transformers modeling module (its classes, the RoPE function) is put back, a model
built afterwards is plain, and an engine's copy of the trainer's model runs the plain modules (and so
keeps its direct decode forward). Liger's kernels are Triton (CUDA only): here a stand-in patches
what Liger 0.8's `_apply_liger_kernel_to_instance` patches, the way it does; the real kernels run in
tests/gpu/test_varlen_fuse_gpu.py."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.models.qwen3 import modeling_qwen3

from weir.engine.decode import DecodeForward
from weir.train.liger_scope import apply_liger, strip_liger


class _FusedNorm(torch.nn.Module):
    """Liger's RMSNorm stand-in: the same numbers, another class."""

    def forward(self, x):
        return self.weight * torch.nn.functional.rms_norm(
            x, x.shape[-1:], eps=self.variance_epsilon
        )


class _FusedMLP(torch.nn.Module):
    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _fused_rope(q, k, cos, sin, unsqueeze_dim=1):  # pragma: no cover - must never be called
    raise AssertionError("the stand-in RoPE ran")


def _apply(model, rope=True, rms_norm=True, swiglu=True, **_):
    """Liger's qwen3 patch: module-level classes and function, then the instance's methods."""
    if rope:
        modeling_qwen3.apply_rotary_pos_emb = _fused_rope
    if rms_norm:
        modeling_qwen3.Qwen3RMSNorm = _FusedNorm
    if swiglu:
        modeling_qwen3.Qwen3MLP = _FusedMLP
    for m in model.modules():
        if type(m).__name__ == "Qwen3RMSNorm" and rms_norm:
            m.variance_epsilon = m.variance_epsilon
            m.forward = types.MethodType(_FusedNorm.forward, m)
            m._get_name = types.MethodType(lambda self: "LigerRMSNorm", m)
        if type(m).__name__ == "Qwen3MLP" and swiglu:
            m.forward = types.MethodType(_FusedMLP.forward, m)


@pytest.fixture
def stand_in(monkeypatch):
    pkg = types.ModuleType("liger_kernel.transformers.monkey_patch")
    pkg._apply_liger_kernel_to_instance = lambda model, **kw: _apply(model, **kw)
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", pkg)
    saved = dict(vars(modeling_qwen3))
    yield
    for key, value in saved.items():  # should the scoping fail, the next tests still run plain
        setattr(modeling_qwen3, key, value)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def test_only_the_trainers_modules_are_fused(stand_in):
    before = dict(vars(modeling_qwen3))
    trainer = _model()
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        want = trainer(input_ids=ids).logits
    undone = apply_liger(trainer)
    # the modeling module is as it was: classes and RoPE put back, nothing added
    assert vars(modeling_qwen3) == before
    assert {f"{modeling_qwen3.__name__}.{k}" for k in ("Qwen3RMSNorm", "Qwen3MLP")} <= set(undone)
    norms = [m for m in trainer.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert norms and all("forward" in vars(m) for m in norms)  # the trainer's: fused
    with torch.no_grad():  # the same numbers (and RoPE the module's own: the stand-in's raises)
        assert torch.allclose(trainer(input_ids=ids).logits, want, atol=1e-5)
    later = _model()  # built afterwards: plain classes, plain forwards
    assert all(not vars(m).get("forward") for m in later.modules())
    assert {type(m).__name__ for m in later.modules()} >= {"Qwen3RMSNorm", "Qwen3MLP"}
    assert DecodeForward.build(later, per_layer_type=False) is not None
    # an engine's copy of the fused trainer: without the strip it would lose its direct decode
    engine = copy.deepcopy(trainer)
    assert DecodeForward.build(engine, per_layer_type=False) is None
    assert strip_liger(engine) == len(norms) + 2  # the norms and the two layers' MLPs
    assert DecodeForward.build(engine, per_layer_type=False) is not None
    assert all("forward" in vars(m) for m in norms)  # the trainer keeps its fused modules
    with torch.no_grad():
        assert torch.allclose(engine(input_ids=ids).logits, want, atol=1e-5)
