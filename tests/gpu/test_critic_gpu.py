"""The critic on CUDA: fp32 master weights, bf16 compute, values close to the CPU's, a finite update,
and its state round trip from GPU tensors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from weir.config import build_config
from weir.train.batch import make_batch
from weir.train.critic import Critic, CriticSettings, value_model_from

pytestmark = pytest.mark.gpu


def _critic(model_dir, device: str) -> Critic:
    cfg = build_config(
        {}, ["rollout.batch_prompts=2", "rollout.n=4", "algo.advantage=gae", "critic.lr=1e-3"]
    )
    lm = AutoModelForCausalLM.from_pretrained(model_dir).to(device)
    critic = Critic(value_model_from(lm, share=False), CriticSettings.from_config(cfg))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = critic.model.head.weight
        w.copy_(0.1 * torch.randn(w.shape, generator=g).to(device))
    return critic


def test_critic_on_cuda_in_mixed_precision(tiny_model_dir, tmp_path):
    batch = make_batch(toy_groups(), version=0)
    cpu, gpu = _critic(tiny_model_dir, "cpu"), _critic(tiny_model_dir, "cuda")
    assert gpu.precision.mixed and next(gpu.model.parameters()).dtype == torch.float32
    v_cpu, _, _ = cpu.values(batch, batch.response_mask)
    v_gpu, m, _ = gpu.values(batch.to("cuda"), batch.response_mask.cuda())
    assert v_gpu.device.type == "cuda"
    assert torch.allclose(v_gpu.cpu(), v_cpu, atol=0.05, rtol=0.05)  # bf16 matmuls
    before = [p.detach().clone() for p in gpu.model.parameters()]
    returns = batch.rewards.cuda()[:, None] * m
    stats = gpu.train(batch, v_gpu, returns, m)
    assert stats["critic/skipped_updates"] == 0 and stats["critic/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, gpu.model.parameters(), strict=True))
    gpu.save(tmp_path / "critic")
    again = _critic(tiny_model_dir, "cuda")
    again.load(tmp_path / "critic")
    for a, b in zip(gpu.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)
