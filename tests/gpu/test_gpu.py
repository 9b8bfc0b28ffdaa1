"""What can only be checked on a GPU: placement on CUDA, bf16 kernels, CUDA memory and RNG state."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from weir.config import build_config
from weir.engine.base import SamplingParams
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.packing import response_logprobs

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)


def _cfg(*extra: str):
    return build_config({}, ["rollout.batch_prompts=2", "rollout.n=4", *extra])


def test_auto_resolves_to_cuda_with_bf16_compute_and_fp32_masters(tiny_model_dir):
    from weir.train.precision import Precision

    p = Precision.from_config(_cfg().train)
    assert p.device.type == "cuda"
    assert (p.param_dtype, p.compute_dtype) == (torch.float32, torch.bfloat16)


def test_a_training_step_on_cuda_in_mixed_precision(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA)
    actor = Actor(model, ActorSettings.from_config(_cfg("train.lr=1e-6", "train.grad_clip=null")))
    assert actor.precision.mixed
    before = [p.detach().clone() for p in model.parameters()]
    stats = actor.train(make_batch(toy_groups(), version=0))
    assert math.isfinite(stats["train/grad_norm"]) and stats["train/grad_norm"] > 0
    moved = sum(
        int((p.detach() != b).sum()) for p, b in zip(model.parameters(), before, strict=True)
    )
    total = sum(int((p.grad != 0).sum()) for p in model.parameters() if p.grad is not None)
    assert moved / total > 0.95  # lr 1e-6 survives on the float32 masters
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in model.parameters())


def test_packed_and_padded_agree_on_cuda(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(6, 200, (n,), generator=g).tolist() for n in (17, 40, 9, 64)]
    lens = [5, 20, 3, 30]
    with torch.no_grad():
        a = response_logprobs(model, seqs, lens, layout="packed").logprobs
        b = response_logprobs(model, seqs, lens, layout="padded").logprobs
    assert torch.allclose(a, b, atol=1e-4)


def test_flash_attention_2_packed_matches_sdpa_padded(tiny_model_dir):
    pytest.importorskip("flash_attn")
    fa2 = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, attn_implementation="flash_attention_2", dtype=torch.bfloat16
    ).to(CUDA)
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).to(CUDA)
    from weir.train.packing import choose_layout

    assert choose_layout(fa2, "auto") == "packed"
    seqs = [list(range(6, 6 + n)) for n in (33, 12, 70)]
    lens = [10, 4, 30]
    with torch.no_grad():
        a = response_logprobs(fa2, seqs, lens, layout="packed").logprobs
        b = response_logprobs(sdpa, seqs, lens, layout="padded").logprobs
    assert (a - b).abs().max() < 0.05  # bf16 kernels of two attention implementations


def test_gradient_checkpointing_lowers_cuda_peak_memory(tiny_model_dir):
    from weir.train.actor import grad_mode, prepare_for_training

    peaks, grads = [], []
    seqs = [[6 + i % 250 for i in range(400)]] * 8  # ids inside the tiny model's 262
    lens = [200] * 8
    for ckpt in (False, True):
        model = prepare_for_training(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA), checkpointing=ckpt
        )
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with grad_mode(model, ckpt):
            response_logprobs(model, seqs, lens, layout="padded").logprobs.sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)
    assert peaks[1] < peaks[0]


def test_engine_in_bf16_on_cuda_generates(tiny_model_dir):
    from weir.engine.torch_engine import TorchEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).to(CUDA)
    with TorchEngine(model.eval(), eos_token_ids=[1], pad_token_id=0, seed=0) as engine:
        out = engine.generate_many(
            [[3, 22, 23, 16]] * 4, SamplingParams(n=2, max_new_tokens=16, seed=0)
        )
    assert all(
        len(c.token_ids) > 0 and all(math.isfinite(x) for x in c.logprobs) for o in out for c in o
    )


def test_a_run_on_cuda_checkpoints_the_cuda_rng(tmp_path):
    import weir

    overrides = [
        "model.path=tiny:nano",
        "run.steps=2",
        "run.checkpoint_every=1",
        "run.eval_every=0",
        "rollout.batch_prompts=2",
        "rollout.n=2",
        "rollout.max_new_tokens=8",
        "telemetry.console=false",
        f"run.dir={tmp_path}",
    ]
    result = weir.run({}, overrides)
    assert len([h for h in result.history if "train/grad_norm" in h]) == 2
    ckpts = sorted((tmp_path / "checkpoints").glob("step_*"))
    rng = torch.load(ckpts[-1] / "rng.pt", weights_only=False)
    assert rng["cuda"] is not None and len(rng["cuda"]) == torch.cuda.device_count()


@pytest.mark.parametrize("offload", [False, True])
def test_fsdp2_on_cuda_computes_in_bf16_on_fp32_shards(tiny_model_dir, offload):
    """The Ray trainer's path in a one-rank NCCL group: bf16 compute, fp32 shards, CPU offload."""
    import torch.distributed as dist

    from weir.train.distributed import free_port
    from weir.train.sharded_actor import ShardedActor

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA)
        actor = ShardedActor(
            model,
            ActorSettings.from_config(_cfg("train.lr=1e-6", f"train.offload_optimizer={offload}")),
        )
        seen = []
        model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
            lambda mod, args: seen.append((mod.weight.dtype, mod.weight.device.type))
        )
        stats = actor.train(make_batch(toy_groups(), version=0))
        assert math.isfinite(stats["train/grad_norm"]) and stats["train/grad_norm"] > 0
        assert set(seen) == {(torch.bfloat16, "cuda")}
        shard = next(model.parameters()).to_local()
        assert shard.dtype == torch.float32
        assert shard.device.type == ("cpu" if offload else "cuda")
    finally:
        dist.destroy_process_group()
