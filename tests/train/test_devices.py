"""Every tensor that meets the model lives on the model's device.

No accelerator here, so the model is moved to a CPU-backed fake device (tests/fake_device.py):
any operation that mixes it with a CPU tensor raises inside the dispatcher, as CUDA would, while
the numbers stay real so the fake run can be compared with the CPU run.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.adam_compare import assert_adamw_weights_agree
from tests.fake_device import DeviceMismatch, FakeDevice, OnDevice, move_module
from tests.toy import toy_groups
from weir.config import build_config
from weir.engine.base import SamplingParams
from weir.engine.torch_engine import TorchEngine
from weir.loop.components import engine_placement, make_engine
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import TrainBatch, make_batch


def _cfg(*extra: str):
    return build_config({}, ["rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-3", *extra])


def test_the_harness_refuses_a_cpu_tensor_next_to_a_device_tensor():
    with FakeDevice() as fd:
        x = torch.ones(3).to(fd.device)
        assert isinstance(x, OnDevice) and x.device == fd.device
        assert torch.equal((x * 2).to("cpu"), torch.full((3,), 2.0))
        assert (x + torch.tensor(1.0)).sum().item() == 6.0  # a 0-d CPU scalar is allowed
        with pytest.raises(DeviceMismatch):
            x + torch.ones(3)


@pytest.mark.parametrize("packing", ["padded", "packed"])
def test_a_training_step_on_another_device_matches_the_cpu_step(tiny_model_dir, packing):
    """One RL step (recomputed old log-probs, reference KL, loss, backward, AdamW) with the model on
    the fake device: no mixed-device operation anywhere, and the same numbers as on the CPU."""
    cfg = _cfg(f"train.packing={packing}", "algo.kl.coef=0.01")
    results = []
    for fake in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        mode = FakeDevice() if fake else contextlib.nullcontext()
        with mode:
            if fake:
                move_module(model, mode.device)
            actor = Actor(model, ActorSettings.from_config(cfg))
            stats = actor.train(make_batch(toy_groups(), version=0))
            grads = torch.cat([p.grad.reshape(-1).to("cpu") for p in model.parameters()])
            weights = torch.cat([p.detach().reshape(-1).to("cpu") for p in model.parameters()])
        results.append((stats, grads, weights))
    (cpu_stats, cpu_g, cpu_w), (dev_stats, dev_g, dev_w) = results
    assert dev_stats["train/grad_norm"] == pytest.approx(cpu_stats["train/grad_norm"], rel=1e-6)
    assert dev_stats["kl/ref"] == pytest.approx(cpu_stats["kl/ref"], abs=1e-7)
    # gradients: the same up to summation order (seen: 2.5e-8 of a largest |g| of 0.05)
    assert torch.allclose(dev_g, cpu_g, rtol=0, atol=1e-6)
    # the first AdamW step: sqrt(v_hat) = |g| (tests/adam_compare.py); this batch leaves 4% of
    # the weights with |g| < 1e3 * eps, where the two steps are not comparable
    smaller = torch.minimum(cpu_g.abs(), dev_g.abs())
    assert_adamw_weights_agree(cpu_w, dev_w, smaller, lr=cfg.train.lr, max_step=1.0)


def test_a_batch_left_on_the_cpu_is_caught(tiny_model_dir, monkeypatch):
    """The check bites: without the batch's move to the model's device the step fails."""
    monkeypatch.setattr(TrainBatch, "to", lambda self, device: self)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with FakeDevice() as fd, pytest.raises(DeviceMismatch):
        move_module(model, fd.device)
        Actor(model, ActorSettings.from_config(_cfg())).train(make_batch(toy_groups(), version=0))


def test_engine_generation_on_another_device_matches_the_cpu(tiny_model_dir, monkeypatch):
    """The engine's prefill, decode and sampling keep every tensor on the model's device."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    prompts = [[3, 22, 23, 16], [3, 5, 6, 7, 8, 9]]
    cpu_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with TorchEngine(cpu_model, eos_token_ids=[1], pad_token_id=0, seed=0) as engine:
        expected = engine.generate_many(prompts, params)

    loop = TorchEngine._loop

    def loop_on_fake_device(self):  # the engine decodes in its own thread: the mode goes there too
        with FakeDevice():
            loop(self)

    monkeypatch.setattr(TorchEngine, "_loop", loop_on_fake_device)
    # wrapper tensors cannot be inference tensors; no_grad computes the same numbers
    monkeypatch.setattr(
        torch,
        "inference_mode",
        lambda mode=True: torch.no_grad() if mode else contextlib.nullcontext(),
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with FakeDevice() as fd:
        move_module(model, fd.device)
        with TorchEngine(model, eos_token_ids=[1], pad_token_id=0, seed=0) as engine:
            got = engine.generate_many(prompts, params)
    for a, b in zip(got, expected, strict=True):
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        for ca, cb in zip(a, b, strict=True):
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-5)


def test_device_keys_are_validated():
    with pytest.raises(ValueError, match="train.device"):
        build_config({}, ["train.device=gpu"])
    cfg = _cfg("train.device=cuda")
    if not torch.cuda.is_available():
        from weir.train.precision import Precision

        with pytest.raises(ValueError, match="train.device=cuda: this machine has no CUDA"):
            Precision.from_config(cfg.train)


def test_engine_keeps_its_own_copy_when_its_dtype_differs(tiny_model_dir):
    """fp32 master weights, bf16 engine: the engine decodes a bf16 copy; weight updates cast in."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    from weir.train.model import load_model

    _, tok = load_model(str(tiny_model_dir))
    shared = make_engine(_cfg(), model, tok)
    assert shared.model is model
    shared.close()
    cfg = _cfg("engine.dtype=bfloat16")
    assert engine_placement(cfg, model) == (torch.device("cpu"), torch.bfloat16)
    engine = make_engine(cfg, model, tok)
    try:
        assert engine.model is not model
        assert next(engine.model.parameters()).dtype == torch.bfloat16
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)
        engine.update_weights_sync(model.named_parameters(), version=1)
        for (name, p), q in zip(model.named_parameters(), engine.model.parameters(), strict=True):
            assert torch.equal(q, p.detach().to(torch.bfloat16)), name
    finally:
        engine.close()


def test_the_whole_sync_loop_runs_on_another_device(tmp_path, monkeypatch):
    """`weir.run` end to end (rollout, eval, reference KL, training, weight push) with the model
    loaded onto the fake device: the same metrics as the CPU run, and nothing failed on the way."""
    import weir
    import weir.loop.components as components
    from weir.train.model import load_model

    def even_tokens(sample, row):
        return sum(t % 2 == 0 for t in sample.response_ids) / max(1, len(sample.response_ids))

    overrides = [
        "model.path=tiny:nano",
        "run.steps=2",
        "run.eval_every=1",
        "run.save_model=false",
        "run.checkpoint_every=0",
        "rollout.batch_prompts=2",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        "data.eval_size=2",
        "telemetry.console=false",
        "algo.kl.coef=0.01",
    ]
    cpu = weir.run({}, [*overrides, f"run.dir={tmp_path / 'cpu'}"], reward=even_tokens)

    loop = TorchEngine._loop

    def loop_on_fake_device(self):
        with FakeDevice():
            loop(self)

    def load_onto_fake_device(path, dtype=None, device=None):
        model, tokenizer = load_model(path, dtype)
        return move_module(model, torch.device("meta")), tokenizer

    monkeypatch.setattr(TorchEngine, "_loop", loop_on_fake_device)
    monkeypatch.setattr(
        torch,
        "inference_mode",
        lambda mode=True: torch.no_grad() if mode else contextlib.nullcontext(),
    )
    monkeypatch.setattr(components, "load_model", load_onto_fake_device)
    with FakeDevice():
        fake = weir.run({}, [*overrides, f"run.dir={tmp_path / 'fake'}"], reward=even_tokens)
    steps = [
        (a, b) for a, b in zip(cpu.history, fake.history, strict=True) if "train/grad_norm" in a
    ]
    assert len(steps) == 2
    for a, b in steps:
        assert a["train/grad_norm"] > 0
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
        assert b["reward/mean"] == a["reward/mean"]
        assert b["rollout/failed"] == 0
    assert [e["eval/reward"] for e in fake.evals] == [e["eval/reward"] for e in cpu.evals]
    assert all(e["eval/failed"] == 0 for e in fake.evals)
