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


def test_an_engine_takes_buckets_in_order_and_maps_a_reused_buffer_once(monkeypatch):
    """Rank 0 hands bucket 1 over before the engine has read bucket 0 (two staging buffers): the
    engine still loads them in order, maps each buffer once, and releases each sender after its
    bucket is copied."""
    import threading

    import weir.sync.handoff as handoff
    from weir.sync.broadcast import TensorMeta

    cpu = torch.device("cpu")
    buffers = [alloc_shareable(16, torch.uint8, cpu) for _ in range(2)]
    handles = [share(b) for b in buffers]
    values = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0, 6.0])]
    buckets = [[TensorMeta(name, (2,), "float32")] for name in ("a", "b", "c")]
    opened = []
    real_open = handoff.open_handle
    monkeypatch.setattr(handoff, "open_handle", lambda h, d: opened.append(h) or real_open(h, d))
    inbox = handoff.Inbox()
    done = [threading.Event() for _ in buckets]
    buffers[1][:8].view(torch.float32).copy_(values[1])
    inbox.items.put((1, handles[1], done[1]))  # early
    buffers[0][:8].view(torch.float32).copy_(values[0])
    inbox.items.put((0, handles[0], done[0]))
    got = {}
    for name, tensor in inbox.stream(buckets, cpu):
        got[name] = tensor.clone()
        if name == "b":  # bucket 2 reuses buffer 0, once bucket 0 was copied out of it
            assert done[0].is_set() and not done[1].is_set()
            buffers[0][:8].view(torch.float32).copy_(values[2])
            inbox.items.put((2, handles[0], done[2]))
    assert [got[k].tolist() for k in "abc"] == [v.tolist() for v in values]
    assert all(d.is_set() for d in done) and len(opened) == 2
