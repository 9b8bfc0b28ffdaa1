"""Memory handles: the receiver maps the sender's buffer itself (no copy), by a picklable handle."""

from __future__ import annotations

import pickle

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.sync.handles import alloc_shareable, open_handle, share
from weir.sync.shards import unique_tensors, wire_metas


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]), st.integers(1, 5000))
def test_a_shared_buffer_is_the_same_memory_on_both_sides(dtype, numel):
    buf = alloc_shareable(numel, dtype, torch.device("cpu"))
    buf.copy_(torch.arange(numel) % 97)
    handle = pickle.loads(pickle.dumps(share(buf)))  # it travels through Ray as a pickle
    seen = open_handle(handle)
    assert seen.dtype == dtype and seen.shape == (numel,)
    assert torch.equal(seen, buf)
    buf[numel // 2] = -1  # a write by the sender is visible to the receiver: one memory
    assert seen[numel // 2].item() == -1


def test_tied_tensors_travel_once_and_metas_take_the_wire_dtype():
    w = torch.zeros(4, 3)
    state = {"embed.weight": w, "norm.weight": torch.ones(3), "lm_head.weight": w,
             "pos": torch.arange(5)}  # fmt: skip
    unique = unique_tensors(state)
    assert list(unique) == ["embed.weight", "norm.weight", "pos"]
    metas = {m.name: m for m in wire_metas(unique, torch.bfloat16)}
    assert metas["embed.weight"].shape == (4, 3) and metas["embed.weight"].dtype == "bfloat16"
    assert metas["embed.weight"].nbytes == 4 * 3 * 2
    assert metas["pos"].dtype == "int64"  # integer tensors keep their dtype
