"""A colocated trainer rank on a GPU moves its state to host memory between steps; what moves when.

Run here in one process (a gloo group of one rank) with the offload switched on and the moves
recorded: on a CPU there is no second memory to move to (tests/gpu/test_colocated_ray.py measures
the device memory on a GPU). A group of one trains the plain `Actor`; the same moves hold for an
FSDP2-sharded rank (`sharded`: what a rank of a larger group, or one with
train.offload_optimizer, runs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import weir.sync.endpoints as endpoints
import weir.train.distributed as distributed
from tests.toy import toy_groups
from weir.config import build_config
from weir.sync.broadcast import plan_buckets
from weir.sync.endpoints import SyncTrainerRank
from weir.train.batch import make_batch
from weir.train.distributed import RankSettings, free_port


@pytest.fixture(params=["plain", "sharded"])
def recorded_rank(request, tiny_model_dir, monkeypatch):
    if request.param == "sharded":
        monkeypatch.setattr(distributed, "shards_model", lambda world, train: True)
    cfg = build_config(
        {},
        [
            "rollout.batch_prompts=2",
            "rollout.n=4",
            "train.lr=1e-5",
            "algo.kl.coef=0.01",  # a reference model too
            "cluster.type=ray",
            "cluster.colocate=true",
        ],
    )
    rank = SyncTrainerRank(RankSettings.from_config(cfg), str(tiny_model_dir), 0, 1)
    moves: list[list[str]] = []

    def record(modules, optimizer, device: torch.device, *, pinned: bool) -> int:
        """The modules moved, by name, plus "optimizer" (device: the CPU either way here)."""
        assert pinned  # cluster.offload_pinned, on by default
        names = {id(rank.actor.model): "model", id(rank.actor.ref): "ref"}
        moves.append(
            [names[id(m)] for m in modules if m is not None] + ["optimizer"] * bool(optimizer)
        )
        return 0

    def state_to_device(self, optimizer, device) -> int:  # StateMover: the overlapped moves
        moves.append(["optimizer (overlapped)"])
        return 0

    def state_to_host(self, optimizer) -> int:
        moves.append(["optimizer (overlapped)"])
        return 0

    monkeypatch.setattr(SyncTrainerRank, "_offloads", property(lambda self: True))
    monkeypatch.setattr(endpoints, "move_trainer", record)
    monkeypatch.setattr(endpoints.StateMover, "to_device", state_to_device)
    monkeypatch.setattr(endpoints.StateMover, "to_host", state_to_host)
    rank.setup("127.0.0.1", free_port())
    try:
        yield rank, moves
    finally:
        dist.destroy_process_group()


def test_parameters_stay_on_the_device_from_train_to_the_end_of_the_weight_sync(recorded_rank):
    rank, moves = recorded_rank
    assert moves == [["model", "ref", "optimizer"]]  # set up offloaded: the engines start
    moves.clear()

    stats = rank.train(make_batch(toy_groups(), version=0))
    assert stats["train/grad_norm"] > 0
    assert stats["time/onload"] >= 0 and stats["time/offload"] >= 0
    # all on the device for the step (the optimizer state on a stream of its own, overlapping
    # the forward and backward); then the reference and the optimizer state leave (the state
    # overlapping the sync), and the parameters stay for the sync
    assert moves == [
        ["model", "ref"],
        ["optimizer (overlapped)"],
        ["ref"],
        ["optimizer (overlapped)"],
    ]
    # the gradients are freed rather than moved: the next step zeroes them before its backward
    assert all(p.grad is None for p in rank.actor.model.parameters())
    moves.clear()

    buckets = plan_buckets(rank.layout("bfloat16"), 2**20)
    sent, offload_s = rank.stream(buckets, [], version=1)
    assert sent == sum(m.nbytes for bucket in buckets for m in bucket) and offload_s >= 0
    assert moves == [["model", "ref", "optimizer"]]  # the sync read them; now they leave


def test_one_rank_streams_its_weights_without_a_gather(recorded_rank):
    """A group of one: each bucket holds the parameters themselves, cast to the wire dtype."""
    from weir.sync.shards import gather_buckets

    rank, _ = recorded_rank
    state = rank._sharded()
    buckets = plan_buckets(rank.layout("bfloat16"), 2**16)
    flats = list(gather_buckets(state, buckets, torch.device("cpu"), root=True))
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    want = torch.cat([local(state[m.name]).reshape(-1) for b in buckets for m in b])
    assert torch.equal(torch.cat(flats), want.to(torch.bfloat16))
    # every parameter once: the tied embedding and LM head are one tensor on the wire
    params = {id(p): p for p in rank.actor.model.parameters()}.values()
    assert want.numel() == sum(p.numel() for p in params)
