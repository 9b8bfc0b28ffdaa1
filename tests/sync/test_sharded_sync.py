"""Weight sync from the FSDP2 shards on Ray, colocated: bucket by bucket, by memory handle.

Two trainer ranks, an engine replica in rank 0's bundle (cluster.colocate). Rank 0 gathers one
bucket at a time (with rank 1) and hands it to the replica by shared-memory handle (the CPU counterpart of CUDA
IPC), cast to the engines' bfloat16 before the gathers, so no process holds the full weights.
Measured here: rank 0's peak resident memory during a sync (against the old full gather in the same
process), the engines' weights against the trainer's, an engine's KV memory and outputs across
sleep / wake, and a replica restarted with no peer getting the current version from the shards.
"""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.toy import toy_groups
from weir.cluster import RayCluster
from weir.cluster.ray_cluster import driver_env
from weir.config import build_config
from weir.engine.base import SamplingParams
from weir.engine.router import Router
from weir.loop.ray_build import load_for_engine
from weir.sync.coordinator import WeightSync
from weir.sync.endpoints import SyncEngineWorker, SyncTrainerRank
from weir.tasks.tiny_model import build_tiny_model
from weir.train.batch import make_batch
from weir.train.distributed import RankSettings, TrainerGroup

MB = 2**20
BUCKET_MB = 1


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """A Qwen3 model of ~6M parameters (~24 MB in float32, 12 MB in bfloat16), every tensor under
    one bucket."""
    out = build_tiny_model(tmp_path_factory.mktemp("models") / "wide", size="tiny")
    config = AutoConfig.from_pretrained(out)
    config.update(
        dict(
            hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, layer_types=["full_attention"] * 8,
        )
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


class MeasuredCluster(RayCluster):
    """Actors whose C heap serves every allocation of 64 KiB or more by its own mapping, returned to
    the OS when freed (glibc's MALLOC_MMAP_THRESHOLD_, read at process start): their resident memory
    follows the live tensors, not what the heap kept from earlier work (training, loading)."""

    def _measured(self, options: dict) -> dict:
        env = driver_env()["env_vars"] | {"MALLOC_MMAP_THRESHOLD_": "65536"}
        return options | {"runtime_env": {"env_vars": env}}

    def trainer_options(self, rank: int) -> dict:
        return self._measured(super().trainer_options(rank))

    def engine_options(self, index: int) -> dict:
        return self._measured(super().engine_options(index))


def _memory_rise(actors, call) -> list[int]:
    """How far each actor's resident memory rose above its level before `call()` (peak - start)."""
    ray.get([a.reset_memory_peak.remote() for a in actors])
    before = [m["rss"] for m in ray.get([a.memory.remote() for a in actors])]
    call()
    after = ray.get([a.memory.remote() for a in actors])
    return [m["peak"] - b for m, b in zip(after, before, strict=True)]


@pytest.mark.slow
def test_colocated_sync_streams_buckets_by_handle_and_engines_sleep(ray_local, wide_model_dir):
    cfg = build_config(
        {},
        [
            "rollout.batch_prompts=2",
            "rollout.n=4",
            "train.lr=1e-2",
            "cluster.type=ray",
            "cluster.colocate=true",
            "cluster.trainer.ranks=2",
            "cluster.engines.replicas=1",
            "cluster.trainer.cpus_per_rank=0.5",
            "cluster.engines.cpus=0.5",
            "engine.kv_idle_release_s=null",
            "engine.dtype=bfloat16",
        ],
    )
    cluster = MeasuredCluster(cfg.cluster).start()
    try:
        trainer = TrainerGroup(
            cluster, RankSettings.from_config(cfg), str(wide_model_dir), rank_cls=SyncTrainerRank
        )
        worker = ray.remote(SyncEngineWorker)
        engines = [
            worker.options(**cluster.engine_options(i)).remote(
                cfg.engine, str(wide_model_dir), i, load_for_engine, seed=cfg.run.seed
            )
            for i in range(1)
        ]
        router = Router(engines)
        router.sleep_mode, router.sleep_offload_weights = True, True
        sync = WeightSync(trainer, router, bucket_mb=BUCKET_MB, dtype="bfloat16", host_handles=True)
        rank0 = trainer.rank0
        metas = ray.get(rank0.layout.remote("bfloat16"))  # what travels: bf16 like the engines
        model_bytes, largest = sum(m.nbytes for m in metas), max(m.nbytes for m in metas)
        assert model_bytes > 10 * MB and largest < BUCKET_MB * MB

        trainer.train(make_batch(toy_groups(), version=0))
        stats = sync.push(1)
        assert sync._shared == [0] and sync._members == ()  # handles only, no group
        assert stats["sync/mb"] * MB == pytest.approx(model_bytes, rel=0.01)
        want = trainer.call("weights_hash", "bfloat16")[0]
        assert ray.get([e.weights_hash.remote(None) for e in engines]) == [want]
        assert ray.get([e.version.remote() for e in engines]) == [1]

        # rank 0's peak during a sync: its shards were there before; add its two staging
        # buffers (the engine copies one bucket while rank 0 fills the next)
        streamed, engine = _memory_rise([rank0, engines[0]], lambda: sync.push(2))
        full = _memory_rise([rank0], lambda: (trainer.call("gather"), trainer.call("release")))[0]
        print(
            f"model {model_bytes / MB:.1f} MB, bucket {BUCKET_MB} MB: rank 0 peak +"
            f"{streamed / MB:.1f} MB streamed vs +{full / MB:.1f} MB full gather; "
            f"engine +{engine / MB:.1f} MB"
        )
        assert full > 0.95 * 2 * model_bytes  # float32 masters, gathered whole
        # two buckets and the tensor gathered into one
        assert streamed < 2 * BUCKET_MB * MB + largest + 2 * MB
        # the engine maps the two buffers, copies each bucket into the model and lets them go
        assert engine < 2 * BUCKET_MB * MB + 2 * MB

        # sleep frees the KV cache (and parks the weights); awake, the same greedy outputs. One
        # request at a time: requests sent together may be admitted in batches of other sizes
        # from run to run, and bfloat16 matmuls over another number of rows can round a near tie
        # apart (sent together, the outputs before and after a sleep differed in one run of three)
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)

        def generate():
            async def go():
                return [await router.generate([5, 6, 7, i], params) for i in range(4)]

            return [c[0].token_ids for c in asyncio.run(go())]

        before = generate()
        kv_awake = sum(ray.get(e.memory.remote())["kv"] for e in engines)
        with router.asleep():
            asleep = [ray.get(e.memory.remote())["kv"] for e in engines]
            flags = [ray.get(e.stats.remote())["asleep"] for e in engines]
        print(f"engine KV cache {kv_awake / MB:.2f} MB awake, {sum(asleep) / MB:.2f} MB asleep")
        assert kv_awake > 0 and asleep == [0] and flags == [1.0]
        assert generate() == before
        assert all(s["asleep"] == 0.0 for s in ray.get([e.stats.remote() for e in engines]))

        # restarted with no live peer: the current version is streamed to it from the shards
        router.restore = sync.restore
        ray.kill(engines[0], no_restart=False)
        assert len(generate()) == 4  # the request waits for the restarted replica
        assert router.restarts == 1
        assert ray.get(engines[0].weights_hash.remote(None)) == want
        assert ray.get(engines[0].version.remote()) == 2
        router.close()
        trainer.shutdown()
    finally:
        cluster.shutdown()
