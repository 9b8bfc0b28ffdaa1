"""2 FSDP2 trainer ranks on Ray give the same update as one process on the same data."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from weir.config import build_config
from weir.data.sample import Group, Sample
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.deal import balance
from weir.train.distributed import RankSettings, TrainerGroup

OPTS = [
    "rollout.batch_prompts=2",
    "rollout.n=4",
    "train.lr=1e-2",
    "train.micro_batch_tokens=24",
    "train.mini_batches=2",
    "cluster.type=ray",
]


def _groups() -> list[Group]:
    """Uneven lengths (one long response) so the ranks run different numbers of micro-batches."""
    g = torch.Generator().manual_seed(1)
    groups = []
    for gid in range(2):
        prompt = torch.randint(6, 200, (5,), generator=g).tolist()
        lengths = [30, 3, 4, 5] if gid == 0 else [6, 2, 7, 3]
        samples = [
            Sample(
                prompt_ids=prompt,
                response_ids=torch.randint(6, 200, (n,), generator=g).tolist(),
                versions=[0] * n,
                reward=float(i % 2 == 0),
                group_id=gid,
                index=i,
            )
            for i, n in enumerate(lengths)
        ]
        groups.append(Group(samples=samples, group_id=gid))
    return groups


def test_balance_splits_by_tokens_and_covers_every_row():
    bins = balance([30, 3, 4, 5, 6, 2, 7, 3], 2)
    assert sorted(bins[0] + bins[1]) == list(range(8))
    loads = [sum([30, 3, 4, 5, 6, 2, 7, 3][i] for i in b) for b in bins]
    assert loads == [30, 30]  # 30 alone vs 3+4+5+6+2+7+3


@given(st.lists(st.integers(1, 500), max_size=40), st.integers(1, 8))
def test_balance_is_a_partition_within_one_row_of_even(lengths, ranks):
    bins = balance(lengths, ranks)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b == sorted(b) for b in bins)
    loads = [sum(lengths[i] for i in b) for b in bins]
    if lengths:  # greedy longest-first: no bin exceeds another by more than the longest row
        assert max(loads) - min(loads) <= max(lengths)


@pytest.mark.slow
@pytest.mark.parametrize("kl", [0.0, 0.05])
def test_two_ranks_match_one_rank(ray_local, tiny_model_dir, tmp_path, kl):
    from weir.cluster import RayCluster

    # both sides padded (the prefix layout on ranks: tests/train/test_sharded_shortcuts.py)
    opts = [*OPTS, f"algo.kl.coef={kl}", "algo.old_logprobs=recompute", "train.packing=padded"]
    cfg = build_config({}, [*opts, "cluster.trainer.ranks=2"])
    one = Actor(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        ActorSettings.from_config(build_config({}, opts)),
    )
    # padded rows, without the shortcuts (with 2 mini-batches and rewards spread in
    # every group the ranks take none either): Adam turns rounding differences in near-zero
    # gradients into lr-sized weight differences
    one.fuses_old_logprobs = one.skips_dead_backward = False
    batch = make_batch(_groups(), version=0)
    batch.rollout_logprobs = one.logprobs(one.model, batch) - 0.05  # importance ratios != 1
    cluster = RayCluster(cfg.cluster).start()
    try:
        group = TrainerGroup(cluster, RankSettings.from_config(cfg), str(tiny_model_dir))
        for _ in range(2):
            want = one.train(batch)
            got = group.train(batch)
            for key in ("train/loss", "policy/pg_loss", "train/grad_norm", "train/entropy"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
            if kl:
                assert got["kl/ref"] == pytest.approx(want["kl/ref"], rel=1e-4, abs=1e-7)
        trained = dict(group.weights())
        ref = dict(one.model.state_dict())
        moved = max((ref[k] - v).abs().max().item() for k, v in trained.items())
        start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        assert max((ref[k] - start[k]).abs().max().item() for k in ref) > 1e-3  # it trained
        assert moved < 1e-5
        # a DCP checkpoint restores model, optimizer and schedule: the next step repeats exactly
        path = tmp_path / "ckpt"
        group.save(path)
        again = group.train(batch)
        after = dict(group.weights())
        group.load(path)
        repeat = group.train(batch)
        for key in ("train/loss", "train/grad_norm", "train/lr", "policy/pg_loss"):
            assert repeat[key] == pytest.approx(again[key], rel=1e-6), key
        assert all(torch.equal(after[k], v) for k, v in dict(group.weights()).items())
        # the run checkpoint's format: full weights + full optimizer state, sharded back in
        state = {**group.state_dict(), "model": dict(group.weights())}
        assert state["updates"] == one.updates + 2  # one step (2 mini-batches) past the DCP load
        once = group.train(batch)
        group.load_state_dict(state)
        twice = group.train(batch)
        for key in ("train/loss", "train/grad_norm", "train/lr", "policy/pg_loss"):
            assert twice[key] == pytest.approx(once[key], rel=1e-6), key
        group.shutdown()
    finally:
        cluster.shutdown()
