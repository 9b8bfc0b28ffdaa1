"""Mixed precision: float32 master weights and AdamW state, bfloat16 compute (autocast on CPU here)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.fake_device import FakeDevice, OnDevice, move_module
from tests.toy import toy_groups
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.optim import OffloadedAdamW
from weir.train.precision import Precision


def _cfg(*extra: str):
    return build_config({}, ["rollout.batch_prompts=2", "rollout.n=4", *extra])


def _moved_fraction(before: list[torch.Tensor], model: torch.nn.Module) -> float:
    """Fraction of the weights that received a gradient and changed in the step."""
    moved = total = 0
    for b, p in zip(before, model.parameters(), strict=True):
        has_grad = p.grad is not None and p.grad.ne(0)
        if p.grad is None:
            continue
        moved += int((p.detach().ne(b) & has_grad).sum())
        total += int(has_grad.sum())
    return moved / total


def _step(model, *extra) -> float:
    actor = Actor(
        model, ActorSettings.from_config(_cfg("train.lr=1e-6", "train.grad_clip=null", *extra))
    )
    before = [p.detach().clone() for p in model.parameters()]
    actor.train(make_batch(toy_groups(), version=0))
    return _moved_fraction(before, model), actor


def test_lr_1e6_updates_survive_on_float32_masters_and_vanish_in_bfloat16(tiny_model_dir):
    """A first AdamW step moves every weight with a gradient by about lr = 1e-6. bfloat16 keeps 8
    significant bits, so a weight |w| > ~2.5e-4 cannot move by 1e-6; float32 masters keep it."""
    mixed, actor = _step(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), "train.compute_dtype=bfloat16"
    )
    assert actor.precision.mixed and actor.precision.compute_dtype == torch.bfloat16
    state = next(iter(actor.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32
    pure_bf16, _ = _step(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16),
    )
    assert mixed > 0.95, mixed
    assert pure_bf16 < 0.05, pure_bf16


def _train_logps(model_dir, steps: int, *extra) -> tuple[torch.Tensor, list[float]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    actor = Actor(model, ActorSettings.from_config(_cfg("train.lr=1e-3", *extra)))
    batch = make_batch(toy_groups(), version=0)
    losses = [actor.train(batch)["train/loss"] for _ in range(steps)]
    reference = Actor(
        model, ActorSettings.from_config(_cfg("train.compute_dtype=float32"))
    )  # measure both in float32
    return reference.logprobs(model, batch) * batch.response_mask, losses


def test_bfloat16_compute_tracks_the_float32_run(tiny_model_dir):
    """Four steps at lr 1e-3 from the same weights: after training, per-token log-probs of the
    bf16-compute run stay within 0.05 nats of the float32 run's (measured here: ~0.01), while
    training itself moved them by far more."""
    start, _ = _train_logps(tiny_model_dir, 0)
    fp32, loss32 = _train_logps(tiny_model_dir, 4, "train.compute_dtype=float32")
    bf16, loss16 = _train_logps(tiny_model_dir, 4, "train.compute_dtype=bfloat16")
    moved = (fp32 - start).abs().max().item()
    gap = (bf16 - fp32).abs().max().item()
    assert moved > 0.3, moved
    assert gap < 0.05, gap
    assert loss16 == pytest.approx(loss32, abs=0.02)


def test_compute_dtype_defaults_and_refusals():
    train = _cfg().train
    p = Precision.from_config(train, device="cpu")
    assert (p.param_dtype, p.compute_dtype, p.mixed) == (torch.float32, torch.float32, False)
    gpu = Precision.from_config(train, device="cuda:0")  # resolution only: nothing is allocated
    assert (gpu.param_dtype, gpu.compute_dtype) == (torch.float32, torch.bfloat16)
    bad = _cfg("train.param_dtype=bfloat16", "train.compute_dtype=float32").train
    with pytest.raises(ValueError, match="train.compute_dtype=float32 with train.param_dtype"):
        Precision.from_config(bad, device="cpu")


def test_model_dtype_still_works_and_names_the_new_keys():
    with pytest.warns(FutureWarning, match="train.param_dtype.*train.compute_dtype.*engine.dtype"):
        cfg = build_config({}, ["model.dtype=bfloat16", "train.compute_dtype=float32"])
    assert cfg.train.param_dtype == "bfloat16" and cfg.engine.dtype == "bfloat16"
    assert cfg.train.compute_dtype == "float32"  # set explicitly: not overridden


def test_offloaded_adamw_matches_adamw_and_keeps_its_state_on_the_host(tiny_model_dir):
    """Same updates as AdamW on the device; with the model on another device, the moments are
    ordinary CPU tensors and the parameters stay where they were."""
    finals = []
    for offload in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        with FakeDevice() as fd:
            move_module(model, fd.device)
            actor = Actor(
                model,
                ActorSettings.from_config(
                    _cfg("train.lr=1e-3", f"train.offload_optimizer={offload}")
                ),
            )
            batch = make_batch(toy_groups(), version=0)
            for _ in range(2):
                actor.train(batch)
            finals.append(torch.cat([p.detach().reshape(-1).to("cpu") for p in model.parameters()]))
            if offload:
                assert isinstance(actor.optimizer, OffloadedAdamW)
                assert all(isinstance(p, OnDevice) for p in model.parameters())
                for state in actor.optimizer.state.values():
                    for v in (state["exp_avg"], state["exp_avg_sq"]):
                        assert not isinstance(v, OnDevice) and v.device.type == "cpu"
    assert (finals[0] - finals[1]).abs().max() < 1e-4
    assert (finals[0] - finals[1]).abs().mean() < 1e-7


def test_rounding_tolerance_treats_tf32_matmuls_as_reduced_precision():
    """On CUDA with TF32 on, float32 matmuls keep 10 mantissa bits: a packed-vs-alone difference
    of 4e-4 nats (measured on an H100, 0.5B shape) is rounding there, not a mask error."""
    from weir.config.devices import rounding_tolerance

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = True
        assert rounding_tolerance(torch.float32, cuda) == 2e-2
        assert rounding_tolerance(torch.float32, cpu) == rounding_tolerance(torch.float32) == 1e-4
        assert rounding_tolerance(torch.bfloat16, cpu) == 2e-2
        matmul.allow_tf32 = False
        assert rounding_tolerance(torch.float32, cuda) == 1e-4
    finally:
        matmul.allow_tf32 = before


def test_cudnn_attention_is_forbidden_on_cuda_unless_asked():
    from weir.config.devices import set_cudnn_attention

    assert _cfg().model.cudnn_attention is False
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert set_cudnn_attention(torch.device("cpu"), False) is False
        assert torch.backends.cuda.cudnn_sdp_enabled()  # a CPU run leaves the process alone
        assert set_cudnn_attention(torch.device("cuda", 0), False) is True
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        set_cudnn_attention(torch.device("cuda", 0), True)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_cuda_device_without_an_index_resolves_to_the_current_one(monkeypatch):
    """`torch.cuda.set_device` refuses a bare "cuda", and a tensor there reports "cuda:N"."""
    from weir.config import devices

    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert devices.resolve_device("cuda") == torch.device("cuda", 1)
    assert devices.resolve_device("cuda:0") == torch.device("cuda", 0)
    assert devices.resolve_device("auto") == torch.device("cuda", 1)
