"""Distillation on an FSDP2 trainer rank (the Ray trainer's process, here in this process, world 1,
sharded as a rank of a larger group is): the teacher directory is read shard by shard into FSDP2
units like the reference, and the rank takes the step one plain process takes; a group of one
rank, which trains the plain `Actor`, loads the teacher whole as one process does. (That ranks add up to one process is checked for every
step in tests/train/test_sharded_shortcuts.py; what this adds is the teacher's sharding.)"""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM

import weir.train.distributed as distributed
from tests.toy import toy_groups
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.distributed import RankSettings, TrainerRank, free_port

OPTS = ["rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-3", "model.threads=1"]
KEYS = ("train/loss", "train/grad_norm", "distill/reverse_kl", "distill/teacher_logp")


@pytest.mark.parametrize("sharded", [True, False])
def test_a_rank_distils_as_one_process(tiny_model_dir, tmp_path, monkeypatch, sharded):
    from weir.tasks.tiny_model import build_tiny_model

    teacher = build_tiny_model(tmp_path / "teacher", size="nano", seed=3)
    cfg = build_config({}, [*OPTS, f"algo.distill.teacher={teacher}"])
    if sharded:
        monkeypatch.setattr(distributed, "shards_model", lambda world, train: True)
    rank = TrainerRank(RankSettings.from_config(cfg), str(tiny_model_dir), 0, 1)
    try:
        rank.setup("127.0.0.1", free_port())
        assert rank.start_stats()["meta"] == 1.0
        # sharded: its shard, not a whole copy
        assert isinstance(rank.actor.teacher.model, FSDPModule) == sharded
        got = rank.train(make_batch(toy_groups(), version=0))
    finally:
        rank.close()
    one = Actor(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), ActorSettings.from_config(cfg)
    )
    want = one.train(make_batch(toy_groups(), version=0))
    for key in KEYS:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
