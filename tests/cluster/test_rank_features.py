"""LoRA and the critic live in the trainer rank: 2 FSDP2 ranks on Ray give the same LoRA update and
the same critic update as one process on the same data, and a sharded checkpoint brings both back
exactly."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoModelForCausalLM

from tests.cluster.test_fsdp_trainer import OPTS, _groups
from weir.config import build_config
from weir.sync.endpoints import SyncTrainerRank
from weir.train.actor import ActorSettings
from weir.train.batch import make_batch
from weir.train.critic import Critic, CriticSettings, value_model_from
from weir.train.distributed import RankSettings, TrainerGroup
from weir.train.lora import LoraActor, apply_lora, merged_weights

FEATURES = [
    *OPTS,
    "train.packing=padded",
    "algo.old_logprobs=recompute",
    "algo.kl.coef=0.05",  # LoRA's reference: the same model with its adapters off
    "lora.enabled=true",
    "lora.rank=4",
    "algo.advantage=gae",
    "critic.lr=1e-2",
]
KEYS = ("train/loss", "policy/pg_loss", "train/grad_norm", "kl/ref")
CRITIC_KEYS = ("critic/value_loss", "critic/grad_norm", "critic/values_mean", "critic/value_error")


@pytest.mark.slow
def test_lora_and_critic_on_two_ranks_match_one_process(ray_local, tiny_model_dir, tmp_path):
    from weir.cluster import RayCluster

    cfg = build_config({}, [*FEATURES, "cluster.trainer.ranks=2"])
    one_cfg = build_config({}, FEATURES)
    model = apply_lora(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), one_cfg.lora, seed=one_cfg.run.seed
    )
    one = LoraActor(model, ActorSettings.from_config(one_cfg))
    one.fuses_old_logprobs = one.skips_dead_backward = False  # as the ranks (padded, 2 minis)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    critic = Critic(value_model_from(plain, share=True), CriticSettings.from_config(one_cfg))
    critic.layout = "padded"  # the ranks' critic layout
    batch = make_batch(_groups(), version=0)
    batch.rollout_logprobs = one.logprobs(one.model, batch) - 0.05  # importance ratios != 1
    cluster = RayCluster(cfg.cluster).start()
    try:
        settings = dataclasses.replace(RankSettings.from_config(cfg))
        assert settings.lora is not None and settings.critic is not None
        group = TrainerGroup(cluster, settings, str(tiny_model_dir), rank_cls=SyncTrainerRank)
        for _ in range(2):
            want = one.train(batch, critic=critic)
            got = group.train(batch)
            for key in (*KEYS, *CRITIC_KEYS):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        # what the engines get: the merged weights W + s B A, gathered from the shards
        want_merged = {k: v.detach() for k, v in merged_weights(one.model)}
        group.call("gather")  # rank 0 holds them until release
        full = group.get([group.rank0.cached.remote()])[0]
        group.get([group.rank0.release.remote()])
        assert set(full) == set(want_merged)
        diff = max((full[k] - v).abs().max().item() for k, v in want_merged.items())
        start = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
        moved = max((want_merged[k] - start[k]).abs().max().item() for k in want_merged)
        assert diff < 1e-5 < 1e-3 < moved, (diff, moved)  # trained, and the same on both sides
        # the adapter alone (lora.sync=adapter): A and B, gathered and written by rank 0
        adapter = group.call("write_adapter", str(tmp_path / "adapter"))[0]
        lora_bytes = sum(p.numel() * 4 for n, p in one.model.named_parameters() if "lora_" in n)
        assert adapter == lora_bytes
        assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

        # a sharded checkpoint holds policy and critic (weights, optimizers, schedules, counters)
        path = tmp_path / "ckpt"
        group.save(path)
        again = group.train(batch)
        group.load(path)
        repeat = group.train(batch)
        for key in (*KEYS, *CRITIC_KEYS, "critic/lr", "train/lr"):
            assert repeat[key] == pytest.approx(again[key], rel=1e-6), key
        group.shutdown()
    finally:
        cluster.shutdown()
