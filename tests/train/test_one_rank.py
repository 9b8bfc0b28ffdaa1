"""A trainer group of one rank (a colocated trainer on one GPU) trains the plain `Actor`: the step
of `cluster.type=local`, op for op, and not FSDP2 over a world of one; its checkpoints load into
FSDP2-sharded ranks and theirs into it. Each rank here is in this process (a gloo group of one)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

import weir.train.distributed as distributed
from tests.toy import toy_groups
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.distributed import RankSettings, TrainerRank, free_port
from weir.train.sharded_actor import ShardedActor

OPTS = ["rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-3", "algo.kl.coef=0.01"]
KEYS = ("train/loss", "train/grad_norm", "policy/pg_loss", "kl/ref")


def _rank(model_dir, *, sharded: bool = False, monkeypatch=None, opts=OPTS) -> TrainerRank:
    if sharded:  # what a rank of a larger group runs
        monkeypatch.setattr(distributed, "shards_model", lambda world, train: True)
    rank = TrainerRank(RankSettings.from_config(build_config({}, opts)), str(model_dir), 0, 1)
    rank.setup("127.0.0.1", free_port())
    if sharded:
        monkeypatch.undo()
    return rank


def _ops(step) -> tuple[dict[str, float], Counter]:
    """`step()`'s metrics and the operators it ran (each aten op and autograd node by name, the
    value reads and copies to the host among them, FSDP2's hooks and DTensor dispatch if any)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        stats = step()
    return stats, Counter(e.name for e in prof.events())


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_rank_runs_the_local_step_op_for_op(tiny_model_dir, monkeypatch):
    """Two steps (the reference model of the KL term too): the same metrics, the same weights
    after them, and the same operators in the same numbers as the local `Actor` (so no collective,
    no host read and no copy the local step does not make); an FSDP2 rank runs others."""
    first, second = make_batch(toy_groups(0), version=0), make_batch(toy_groups(1), version=1)
    cfg = build_config({}, OPTS)
    local = Actor(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), ActorSettings.from_config(cfg)
    )
    rank = _rank(tiny_model_dir)
    try:
        assert type(rank.actor) is Actor
        assert rank.start_stats()["meta"] == 1.0  # still read straight from the files
        want = [local.train(first)]
        got = [rank.train(first)]
        want_stats, want_ops = _ops(lambda: local.train(second))
        got_stats, got_ops = _ops(lambda: rank.train(second))
        want.append(want_stats)
        got.append(got_stats)
        after = _weights(rank.actor.model)
    finally:
        rank.close()
    for g, w in zip(got, want, strict=True):
        for key in KEYS:
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), key
    for name, p in _weights(local.model).items():
        assert torch.allclose(after[name], p, rtol=0, atol=1e-6), name
    assert got_ops == want_ops
    assert not any(k.startswith(("FSDP::", "c10d::", "gloo:")) for k in got_ops)

    sharded = _rank(tiny_model_dir, sharded=True, monkeypatch=monkeypatch)
    try:
        assert isinstance(sharded.actor, ShardedActor)
        sharded.train(first)
        _, fsdp_ops = _ops(lambda: sharded.train(second))
    finally:
        sharded.close()
    assert any(k.startswith("FSDP::") for k in fsdp_ops) and fsdp_ops != want_ops


@pytest.mark.parametrize("saved_by", ["one rank", "sharded rank"])
def test_checkpoints_move_between_one_rank_and_sharded_ranks(
    tiny_model_dir, tmp_path, monkeypatch, saved_by
):
    """A run checkpointed on one rank resumes on FSDP2-sharded ranks and the other way round: the
    next update, which needs the restored Adam moments, is the one the saving rank made."""
    first, second = make_batch(toy_groups(0), version=0), make_batch(toy_groups(1), version=1)
    path = tmp_path / "trainer"
    saver = _rank(tiny_model_dir, sharded=saved_by != "one rank", monkeypatch=monkeypatch)
    try:
        saver.train(first)
        saver.save(str(path))
        want = saver.train(second)
        after = saver.full_state()
    finally:
        saver.close()
    loader = _rank(tiny_model_dir, sharded=saved_by == "one rank", monkeypatch=monkeypatch)
    try:
        assert isinstance(loader.actor, ShardedActor) == (saved_by == "one rank")
        loader.load(str(path))
        got = loader.train(second)
        resumed = loader.full_state()
    finally:
        loader.close()
    for key in KEYS:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert set(resumed) == set(after)
    for name, p in after.items():
        assert torch.allclose(resumed[name], p, rtol=0, atol=1e-6), name


def test_optimizer_offload_keeps_fsdp2_on_one_rank():
    """train.offload_optimizer: FSDP2's CPU offload, whose state checkpoints by parameter name."""
    train = build_config({}, ["train.offload_optimizer=true"]).train
    assert distributed.shards_model(1, train)
    assert not distributed.shards_model(1, build_config({}, []).train)
    assert distributed.shards_model(2, build_config({}, []).train)
