"""A trainer rank on CUDA (NCCL, one rank) starts from the meta device, checkpoints its shards and
loads them back; the CPU tests run the same code on gloo."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from weir.config import build_config
from weir.train.batch import make_batch
from weir.train.distributed import RankSettings, TrainerRank, free_port


@pytest.mark.parametrize("offload", [False, True])
def test_meta_start_on_cuda_loads_the_weights_and_checkpoints(tiny_model_dir, tmp_path, offload):
    cfg = build_config(
        {},
        [
            "rollout.batch_prompts=2",
            "rollout.n=4",
            "train.lr=1e-3",
            "algo.kl.coef=0.05",
            "cluster.trainer.gpus_per_rank=1",
            f"train.offload_optimizer={str(offload).lower()}",
        ],
    )
    rank = TrainerRank(RankSettings.from_config(cfg), str(tiny_model_dir), 0, 1)
    try:
        rank.setup("127.0.0.1", free_port())
        assert rank.start_stats()["meta"] == 1.0
        want = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        got = rank.full_state()
        assert set(got) == set(want)
        assert all(torch.equal(got[k].cpu(), want[k]) for k in want)  # read exactly from disk
        batch = make_batch(toy_groups(), version=0)
        rank.train(batch)
        rank.save(str(tmp_path / "trainer"))
        again = rank.train(batch)
        rank.load(str(tmp_path / "trainer"))
        repeat = rank.train(batch)
        for key in ("train/loss", "train/grad_norm", "kl/ref"):
            assert repeat[key] == pytest.approx(again[key], rel=1e-5), key
    finally:
        rank.close()
