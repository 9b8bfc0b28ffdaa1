"""One GPU, colocated on Ray: trainer rank and engine share the device and take turns.

A model of Qwen2.5-0.5B's shape (24 layers, hidden 896; weir's byte tokenizer for its vocabulary)
trains on Ray with `cluster.colocate`: the trainer rank holds its parameters and optimizer state in
host memory except while it trains, the engine sleeps (KV cache freed, weights parked in host
memory) while the trainer trains, and the weights reach the engine by CUDA IPC handle, bucket by
bucket, in bfloat16. Prints the sync's seconds per GB.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tests.toy import toy_groups
from weir.config import build_config
from weir.engine.base import SamplingParams
from weir.loop.ray_build import build_ray
from weir.tasks.tiny_model import build_tokenizer
from weir.train.batch import make_batch

GB = 2**30


@pytest.fixture(scope="module")
def half_b_dir(tmp_path_factory):
    tok = build_tokenizer()
    config = Qwen2Config(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=len(tok), tie_word_embeddings=True,
        max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "qwen2-0.5b-shape"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_one_gpu_colocated_ray_sleeps_offloads_and_syncs_by_ipc(ray_local, half_b_dir, tmp_path):
    ray = pytest.importorskip("ray")
    cfg = build_config(
        {},
        [
            "rollout.batch_prompts=2",
            "rollout.n=4",
            "train.lr=1e-5",
            "cluster.type=ray",
            "cluster.colocate=true",
            "cluster.trainer.gpus_per_rank=1",
            "cluster.engines.gpus=0.5",
            "cluster.trainer.cpus_per_rank=1",
            "cluster.engines.cpus=1",
            "cluster.bucket_mb=256",
            "engine.sleep_offload_weights=true",
            "engine.kv_idle_release_s=null",
        ],
    )
    parts = build_ray(cfg, tmp_path, str(half_b_dir))
    try:
        trainer, router, sync = parts.trainer, parts.router, parts.sync
        engine, rank0 = router.replicas[0], trainer.rank0
        # the trainer starts offloaded: the engine generates first
        assert ray.get(rank0.device_memory.remote())["allocated"] < 0.05 * GB

        params = SamplingParams(n=2, temperature=0.0, max_new_tokens=32)

        def generate():
            async def go():
                return await asyncio.gather(
                    *[router.generate([5, 6, 7, i], params) for i in range(4)]
                )

            return [[c.token_ids for c in group] for group in asyncio.run(go())]

        # Sleeping parks the weights in host memory and drops the KV cache; waking must give the
        # exact weights back. Greedy tokens cannot show it: the random-init model's logits are
        # nearly tied, and two generations of the same prompts (other batch compositions, other
        # kernels) followed other tokens on a bf16 rounding on the sixth and seventh GPU runs even
        # when both started after a sleep. So compare the weights themselves, bit for bit.
        before = generate()
        weights = ray.get(engine.weights_hash.remote())
        awake = ray.get(engine.memory.remote())
        with router.asleep():
            asleep = ray.get(engine.memory.remote())
        print(
            f"engine CUDA memory awake {awake['cuda'] / GB:.2f} GB, asleep {asleep['cuda'] / GB:.3f} GB"
        )
        assert awake["kv"] > 0 and asleep["kv"] == 0
        assert ray.get(engine.weights_hash.remote()) == weights
        again = generate()  # and it generates again, its KV cache rebuilt
        assert [len(g) for g in again] == [len(g) for g in before] == [2] * 4
        assert all(len(t) > 0 for g in again for t in g)
        assert ray.get(engine.memory.remote())["kv"] > 0

        restored = ray.get(engine.stats.remote())["wake_restored_bytes"]
        with router.asleep(update_follows=True):  # as the sync loop: the weights come by the sync
            stats = trainer.train(make_batch(toy_groups(), version=0))
        assert stats["train/grad_norm"] > 0
        # after the step the rank keeps its float32 parameters (not the AdamW state, not the
        # gradients) for the sync, which offloads them
        after_step = ray.get(rank0.device_memory.remote())["allocated"]
        params_bytes = sum(f.stat().st_size for f in half_b_dir.glob("*.safetensors"))
        timings = [sync.push(v) for v in (1, 2, 3)]
        memory = ray.get(rank0.device_memory.remote())
        offloaded = memory["allocated"]
        print(
            f"trainer rank CUDA memory after its step {after_step / GB:.3f} GB (float32 weights "
            f"{params_bytes / GB:.3f} GB), after the syncs {offloaded / GB:.3f} GB; in host "
            f"memory {memory['host'] / GB:.3f} GB, of it pinned {memory['pinned'] / GB:.3f} GB"
        )
        # the weights and the AdamW state wait in pinned host memory (cluster.offload_pinned); all
        # of them, since one rank pads no parameter (FSDP2 re-pads uneven shards into ordinary memory)
        assert memory["host"] >= 2.5 * params_bytes and memory["pinned"] == memory["host"]
        assert sync._shared == [0] and not sync._members  # CUDA IPC, no NCCL group
        gb = timings[-1]["sync/mb"] / 1024
        per_gb = sorted(t["time/sync"] / gb for t in timings[1:])
        print(f"sync {gb:.2f} GB (bf16) by CUDA IPC: {per_gb} s/GB")
        want = trainer.call("weights_hash", "bfloat16")[0]
        assert ray.get(engine.weights_hash.remote(None)) == want
        assert ray.get(engine.version.remote()) == 3
        # the sync wrote every parameter the lazy wake left unset: none was copied back
        assert ray.get(engine.stats.remote())["wake_restored_bytes"] == restored
        if os.environ.get("GPU_CHECK_OUT"):  # scripts/gpu_check.sh keeps the figures
            figures = {
                "device": torch.cuda.get_device_name(0),
                "sync_gb_bf16": gb,
                "sync_s_per_gb": per_gb,
                "engine_cuda_gb_awake": awake["cuda"] / GB,
                "engine_cuda_gb_asleep": asleep["cuda"] / GB,
                "trainer_cuda_gb_after_step": after_step / GB,
                "trainer_cuda_gb_offloaded": offloaded / GB,
            }
            out = Path(os.environ["GPU_CHECK_OUT"]) / "colocated_ray.json"
            out.write_text(json.dumps(figures, indent=1))
        # weights, KV cache and the trainer's state given back (checked last, so that a failure
        # here still lets the sync above run on the GPU)
        assert asleep["cuda"] < 0.1 * awake["cuda"]
        assert after_step < 1.25 * params_bytes
        assert offloaded < 0.05 * GB
    finally:
        parts.shutdown()


@pytest.mark.parametrize("features", ["lora-gae", "separate"])
def test_one_gpu_colocated_ray_runs_lora_critic_and_separate_policies(
    ray_local, tmp_path, features
):
    """The features that live in the trainer rank on a GPU (NCCL process group of one rank, FSDP2,
    offload while the engine generates): LoRA adapters applied before sharding with the critic's
    own sharded value model, or a policy per role with an engine group each; every sync checked
    against the shards (`cluster.verify_sync`, CUDA IPC into the colocated engines)."""
    import weir

    over = [
        f"run.dir={tmp_path}",
        "cluster.type=ray",
        "cluster.colocate=true",
        "cluster.trainer.gpus_per_rank=1",
        "cluster.engines.gpus=0.5",
        "cluster.reward_workers=0",
        "cluster.verify_sync=true",
    ]
    config = {
        "run": {"steps": 2, "eval_every": 0, "save_model": False},
        "model": {"path": "tiny:tiny"},
        "data": {"task": "arithmetic", "eval_size": 4},
        "rollout": {"n": 2, "batch_prompts": 4, "max_new_tokens": 4},
        "telemetry": {"console": False},
    }
    if features == "lora-gae":
        over += ["lora.enabled=true", "algo.advantage=gae"]
    else:
        config["rollout"]["function"] = "weir.rollout.multi_agent:rollout"
        config["multi_agent"] = {
            "roles": [{"name": "a"}, {"name": "b"}],
            "scorer": "tests.cluster.test_matrix_on_ray:score",
            "credit": "role",
            "policies": "separate",
        }
    result = weir.run(
        config,
        over,
        reward=(lambda s, row: float(s.index == 0)) if features == "lora-gae" else None,
    )
    steps = [h for h in result.history if "train/loss" in h or "critic/value_loss" in h]
    assert len(steps) == 2 and all(h["sync/verified"] == 1.0 for h in steps)
    if features == "lora-gae":
        assert all("critic/value_loss" in h for h in steps)
