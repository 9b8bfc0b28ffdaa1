"""A trainer step waits for the device a fixed number of times, however many micro-batches it runs:
no value read back, no host copy and no pageable host-to-device copy per micro-batch in weir's code
(counted on a CPU-backed stand-in device, tests/train/sync_counter.py); AdamW is fused where the
parameters are CUDA floats."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.fake_device import move_module
from tests.toy import toy_groups
from tests.train.sync_counter import HostSyncs
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.optim import fusable, make_optimizer


def _step_syncs(model_dir, packing: str, micro_batch_tokens: int, *extra: str) -> HostSyncs:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = build_config(
        {},
        [
            "rollout.batch_prompts=2",
            "rollout.n=4",
            f"train.packing={packing}",
            f"train.micro_batch_tokens={micro_batch_tokens}",
            *extra,
        ],
    )
    with HostSyncs() as syncs:
        move_module(model, syncs.device)
        actor = Actor(model, ActorSettings.from_config(cfg))
        batch = make_batch(toy_groups(), version=0)
        runs = []
        spy = actor._micro_step

        def counted(step, idx, grad):
            runs.append(len(idx))
            return spy(step, idx, grad)

        actor._micro_step = counted
        syncs.clear()
        actor.train(batch)
    syncs.micro_batches = len(runs)
    return syncs


@pytest.mark.parametrize("packing", ["padded", "prefix"])
def test_host_syncs_do_not_grow_with_the_micro_batches(tiny_model_dir, packing):
    one = _step_syncs(tiny_model_dir, packing, 4096)
    many = _step_syncs(tiny_model_dir, packing, 16)
    assert one.micro_batches == 1 and many.micro_batches >= 4
    assert many.total("weir") == one.total("weir"), (one.where, many.where)
    # per step: advantages (8), the step's own checks (3), the trainer/engine ratios' spread
    # (`mismatch/*`, one read), and per update two reads (its counts, then the gradient norm with
    # every micro-batch's metrics)
    assert one.total("weir") <= 15, one.syncs
    assert not any(what == "pageable_to_device" for where, what in many.syncs if where == "weir")


def test_fused_adamw_only_where_every_parameter_is_a_cuda_float():
    cpu = [torch.nn.Parameter(torch.zeros(2))]
    assert not fusable(cpu) and not fusable([])
    assert make_optimizer(cpu, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0).defaults["fused"] in (
        None,
        False,
    )
