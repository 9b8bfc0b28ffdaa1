"""Weight transports deliver exactly the trainer's tensors (checked by hash), with versions."""

from __future__ import annotations

import threading

import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from weir.sync import BroadcastGroup, DiskStore, TensorMeta, plan_buckets, weights_hash
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
    port, got = free_port(), {}

    def member(rank: int) -> None:
        g = BroadcastGroup("127.0.0.1", port, rank, 3, name="t")
        if rank == 0:
            got[0] = g.send(state, buckets)
        else:
            got[rank] = g.recv(buckets)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got[0] == sum(v.numel() * v.element_size() for v in state.values())
    assert weights_hash(got[1]) == weights_hash(got[2]) == weights_hash(state)
