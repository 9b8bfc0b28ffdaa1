"""Weight transports deliver exactly the trainer's tensors (checked by hash), with versions."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from weir.sync import BroadcastGroup, DiskStore, TensorMeta, plan_buckets, weights_hash
from weir.sync.broadcast import ABORT_CHECK_S, SyncAborted, signal_abort
from weir.train.distributed import free_port


@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.sampled_from(["float32", "bfloat16"])),
        min_size=1,
        max_size=30,
    ),
    st.integers(4, 2000),
)
def test_buckets_keep_order_one_dtype_and_the_size_limit(sizes, limit):
    metas = [TensorMeta(f"t{i}", (n,), dt) for i, (n, dt) in enumerate(sizes)]
    buckets = plan_buckets(metas, limit)
    assert [m for b in buckets for m in b] == metas
    for b in buckets:
        assert len({m.dtype for m in b}) == 1
        assert len(b) == 1 or sum(m.nbytes for m in b) <= limit


def test_hash_sees_every_byte_and_name():
    a = {"w": torch.arange(6.0).view(2, 3), "b": torch.zeros(3)}
    same = {"b": torch.zeros(3), "w": torch.arange(6.0).view(2, 3)}
    assert weights_hash(a) == weights_hash(same)
    changed = {"w": a["w"].clone(), "b": a["b"].clone()}
    changed["w"][1, 2] = torch.nextafter(a["w"][1, 2], torch.tensor(9.0))  # one ulp
    assert weights_hash(changed) != weights_hash(a)
    assert weights_hash({"v": a["w"], "b": a["b"]}) != weights_hash(a)


def test_disk_store_is_versioned_atomic_and_pruned(tmp_path, tiny_model_dir):
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    store = DiskStore(tmp_path / "w", keep=2)
    assert store.latest() is None
    for v in (1, 2, 3):
        bumped = {k: t + v for k, t in state.items()}
        store.write(bumped, v)
    assert store.latest() == 3
    version, got = store.read()
    assert version == 3 and weights_hash(got) == weights_hash({k: t + 3 for k, t in state.items()})
    names = sorted(p.name for p in (tmp_path / "w").iterdir())
    assert names == ["LATEST", "v000002", "v000003"]  # no temporary directory left, v1 pruned


def test_broadcast_group_delivers_identical_tensors(tiny_model_dir):
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    metas = [TensorMeta.of(k, v) for k, v in state.items()]
    buckets = plan_buckets(metas, 64 * 1024)  # small buckets: many collectives
    assert len(buckets) > 3
    got = _deliver_in_a_new_group(state, buckets, "t")
    assert got[0] == sum(v.numel() * v.element_size() for v in state.values())
    assert weights_hash(got[1]) == weights_hash(got[2]) == weights_hash(state)


def _deliver_in_a_new_group(state, buckets, name: str) -> dict:
    """Three members (threads) form group `name` and broadcast `state`; what each got (rank 0:
    the bytes it sent)."""
    port, got = free_port(), {}

    def member(rank: int) -> None:
        g = BroadcastGroup("127.0.0.1", port, rank, 3, name=name)
        got[rank] = g.send(state, buckets) if rank == 0 else g.recv(buckets)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def _member_that_dies(port: int, rank: int, size: int, buckets, after: int) -> None:
    """A group member (its own process) that receives `after` buckets and then dies."""
    g = BroadcastGroup("127.0.0.1", port, rank, size, name="t")
    for i, _ in enumerate(g.recv_stream(buckets)):
        if i == after:
            os._exit(1)


def test_a_member_dying_half_way_aborts_the_group_and_the_others_form_a_new_one(tiny_model_dir):
    """Four members, the third dies after a few buckets. Left alone the others would wait out
    gloo's 600 s timeout; once the driver sets the group's abort key every one of them leaves
    within seconds (root: its send fails or is aborted; receivers: `SyncAborted` or the
    collective's own error), and the three form a new group that delivers every tensor."""
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    buckets = plan_buckets([TensorMeta.of(k, v) for k, v in state.items()], 16 * 1024)
    assert len(buckets) > 10
    port = free_port()
    ended: dict[int, BaseException | None] = {}

    def member(rank: int) -> None:
        try:
            g = BroadcastGroup("127.0.0.1", port, rank, 4, name="t")
            g.send(state, buckets) if rank == 0 else g.recv(buckets)
            ended[rank] = None
        except BaseException as err:
            ended[rank] = err

    dying = multiprocessing.get_context("spawn").Process(
        target=_member_that_dies, args=(port, 2, 4, buckets, 3)
    )
    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in (0, 1, 3)]
    for t in threads:
        t.start()
    dying.start()
    dying.join(120)
    assert dying.exitcode == 1
    time.sleep(1.0)  # left alone, whoever waits on the dead member stays waiting
    blocked = [r for r in (0, 1, 3) if r not in ended]
    assert blocked, "every member finished although one died half way"
    start = time.monotonic()
    signal_abort("127.0.0.1", port, "t")
    for t in threads:
        t.join(30)
    assert time.monotonic() - start < 10 * ABORT_CHECK_S + 5
    assert set(ended) == {0, 1, 3} and all(ended[r] is not None for r in blocked)
    assert any(isinstance(ended[r], SyncAborted) for r in blocked), ended

    got = _deliver_in_a_new_group(state, buckets, "t2")
    assert weights_hash(got[1]) == weights_hash(got[2]) == weights_hash(state)


@pytest.mark.parametrize("style", ["weir", "sglang"])
def test_a_member_that_never_joins_is_aborted_while_the_group_forms(style, tiny_model_dir):
    """A member never comes (it died before it joined). Left alone, gloo's rendezvous would hold
    the others until its 600 s timeout; with the group's abort key set they leave within seconds.
    weir's style: three of four members come, all leave, and the three form a new group that
    delivers every tensor. SGLang's style: only rank 0 is weir's (the servers' side is SGLang's
    own, not abortable: the driver restarts such a server), so rank 0 alone comes and leaves."""
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    buckets = plan_buckets([TensorMeta.of(k, v) for k, v in state.items()], 256 * 1024)
    port = free_port()
    ended: dict[int, BaseException | None] = {}
    ours = (0, 1, 2) if style == "weir" else (0,)

    def member(rank: int) -> None:
        try:
            BroadcastGroup("127.0.0.1", port, rank, 4, name="f", style=style)
            ended[rank] = None
        except BaseException as err:
            ended[rank] = err

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in ours]
    for t in threads:
        t.start()
    time.sleep(1.5)
    assert not ended, f"members formed a group of four with one missing: {ended}"
    start = time.monotonic()
    signal_abort("127.0.0.1", port, "f")
    for t in threads:
        t.join(30)
    assert time.monotonic() - start < 10 * ABORT_CHECK_S + 5
    assert set(ended) == set(ours)
    assert all(isinstance(e, SyncAborted) for e in ended.values()), ended
    if style == "sglang":
        return  # its members register the group's name process-wide: one process cannot be three

    got = _deliver_in_a_new_group(state, buckets, "f2")
    assert weights_hash(got[1]) == weights_hash(got[2]) == weights_hash(state)
