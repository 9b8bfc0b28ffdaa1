"""A wake before a weight update (`wake_sync(update_follows=True)`): offloaded weights are not
copied back only for the update to overwrite them; whatever the update does not write, and
everything when no update comes before the next decode step, a sleep or `weights_ready`, is."""

from __future__ import annotations

import copy
import time

import torch
from engine_helpers import assert_parity, make_prompts

from weir.engine import SamplingParams


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_an_update_after_a_lazy_wake_writes_the_weights_and_only_the_rest_is_copied_back(
    make_engine, model
):
    twin = copy.deepcopy(model)  # never offloaded: holds what the engine must compute on
    eng = make_engine(model)
    old = _snapshot(model)
    names = list(old)
    kept = names[-1]  # not in the update: its old values must come back from host memory
    new = {n: old[n] + 0.01 * torch.randn_like(old[n]) for n in names if n != kept}

    eng.sleep_sync(offload_weights=True)
    eng.wake_sync(update_follows=True)
    assert eng.stats()["wake_restored_bytes"] == 0  # nothing copied back at the wake
    eng.update_weights_sync(new.items(), version=1)

    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], new[n]) for n in new)
    assert torch.equal(params[kept], old[kept])
    assert eng.stats()["wake_restored_bytes"] == _bytes([old[kept]])
    twin.load_state_dict(new, strict=False)  # the twin with the update: what the engine holds
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    prompts = make_prompts(3, 3, 9, seed=1)
    for prompt, result in zip(prompts, eng.generate_many(prompts, sp), strict=True):
        assert_parity(twin, prompt, result[0])


def test_without_an_update_the_next_decode_step_restores_every_weight_first(make_engine, model):
    eng = make_engine(model)
    prompts = make_prompts(2, 4, 10, seed=5)
    sp = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=11)
    before = eng.generate_many(prompts, sp)
    old = _snapshot(model)

    eng.sleep_sync(offload_weights=True)
    waiting = eng.submit(prompts[0], sp)  # admitted only after the wake
    time.sleep(0.05)
    eng.wake_sync(update_follows=True)
    got = waiting.result(timeout=30)
    assert [c.token_ids for c in got] == [c.token_ids for c in before[0]]
    assert all(torch.equal(p, old[n]) for n, p in model.named_parameters())
    assert eng.stats()["wake_restored_bytes"] == _bytes(old.values())


def test_weights_ready_and_a_second_sleep_complete_a_lazy_wake(make_engine, model):
    eng = make_engine(model)
    old = _snapshot(model)
    eng.sleep_sync(offload_weights=True)
    eng.wake_sync(update_follows=True)
    eng.weights_ready()
    assert all(torch.equal(p, old[n]) for n, p in model.named_parameters())

    eng.sleep_sync(offload_weights=True)
    eng.wake_sync(update_follows=True)
    eng.sleep_sync(
        offload_weights=True
    )  # asleep again before any update: the values went back first
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    eng.wake_sync()
    assert all(torch.equal(p, old[n]) for n, p in model.named_parameters())
    assert eng.stats()["wake_restored_bytes"] == 3 * _bytes(old.values())
