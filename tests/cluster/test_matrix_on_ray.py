"""Features compose on Ray: a pairwise (all-pairs) covering design over {engine torch / vllm} x
{full / LoRA} x {grpo / gae} x {sync / async} x {one policy / separate policies}, every pair of
values in some cell. Each cell runs 3 steps on a Ray cluster with 2 FSDP2 trainer ranks, with
`cluster.verify_sync`: after every weight sync each engine's weights are hashed against the
trainer's shards (gathered one tensor at a time), and a difference stops the run.

The vLLM cells share two servers that Ray places once for the module (`ServerHost` actors, the
code a run's own placement uses), attached by `engine.urls`: a run gives attached servers the
trainer's weights at its start, then streams every update from the shards over gloo, so the cells
start from their own weights whatever the cell before left there. The same servers serve a sharded
resume on Ray with vLLM (the same metrics as the uninterrupted run) and the memory a sync into a
vLLM worker costs (one bucket, not the model).
"""

from __future__ import annotations

import itertools
import json
import os
import signal

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import weir
from weir.cluster.ray_cluster import driver_env
from weir.config.schema import EngineConfig
from weir.engine.server_host import ray_placement
from weir.engine.vllm_engine import start_vllm
from weir.tasks.tiny_model import build_tiny_model

FACTORS = {
    "engine": ("torch", "vllm"),
    "tuning": ("full", "lora"),
    "advantage": ("grpo", "gae"),
    "loop": ("sync", "async"),
    "policies": ("one", "separate"),
}
CELLS = [  # a covering array of strength 2 (checked below): 6 cells instead of 32
    ("torch", "full", "grpo", "sync", "one"),
    ("torch", "full", "grpo", "sync", "separate"),
    ("torch", "lora", "gae", "async", "one"),
    ("vllm", "full", "gae", "async", "one"),
    ("vllm", "lora", "grpo", "async", "separate"),  # the adapter alone to vLLM (lora.sync)
    ("vllm", "lora", "gae", "sync", "separate"),  # merged weights
]
ADAPTER_CELL = CELLS[4]
BASE = {
    "run": {"steps": 3, "eval_every": 0, "save_model": False, "seed": 11},
    "model": {"threads": 1},
    "data": {"task": "arithmetic", "eval_size": 4},
    "rollout": {"n": 2, "batch_prompts": 4, "max_new_tokens": 4},
    "train": {"lr": 1e-3},
    "telemetry": {"console": False, "trace": False},
}
SEPARATE = {
    "rollout": {**BASE["rollout"], "function": "weir.rollout.multi_agent:rollout"},
    "multi_agent": {
        "roles": [{"name": "a", "prompt": "write digits"}, {"name": "b", "prompt": "answer"}],
        "scorer": "tests.cluster.test_matrix_on_ray:score",
        "credit": "role",
        "policies": "separate",
        "max_tokens": 16,
    },
}
RAY = [
    "cluster.type=ray",
    "cluster.trainer.ranks=2",
    "cluster.engines.replicas=1",
    "cluster.trainer.cpus_per_rank=0.5",
    "cluster.engines.cpus=0.5",
    "cluster.reward_workers=0",
    "cluster.verify_sync=true",
]


def score(episode, row) -> dict[str, float]:
    """Rewards with spread for an untrained model: a role scores 1 when its last turn has an odd
    number of tokens (the team: the last turn of the episode)."""

    def odd(turn) -> float:
        return float(turn is not None and turn.num_tokens % 2 == 1)

    last = {t.role: t for t in episode.turns}
    return {
        "team": odd(episode.turns[-1] if episode.turns else None),
        **{r: odd(last.get(r)) for r in episode.roles},
    }


def _first_of_group(sample, row) -> float:
    return float(sample.index == 0)


def test_the_cells_cover_every_pair_of_values():
    for i, j in itertools.combinations(range(len(FACTORS)), 2):
        seen = {(c[i], c[j]) for c in CELLS}
        a, b = list(FACTORS.values())[i], list(FACTORS.values())[j]
        assert seen == set(itertools.product(a, b)), (i, j, seen)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Qwen3 of 2.5M parameters (10 MB in float32), every tensor under 1 MB: big enough next to
    a 1 MB bucket to tell one bucket from the whole model in a process's memory."""
    out = build_tiny_model(tmp_path_factory.mktemp("models") / "medium", size="tiny")
    config = AutoConfig.from_pretrained(out)
    config.update(
        dict(
            hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, layer_types=["full_attention"] * 4,
        )
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def servers(ray_local, model_dir, tmp_path_factory):
    """Two vLLM servers placed by Ray (able to take LoRA adapters), shared by the module's vLLM
    tests. Their actors run with MALLOC_MMAP_THRESHOLD_=65536 (as tests/sync/test_sharded_sync.py's
    ranks): freed tensors go back to the OS, so a peak of resident memory is one of live tensors."""
    from tests.engine.vllm_fixtures import vllm_python

    cfg = EngineConfig(
        type="vllm", python=vllm_python(), max_model_len=256, replicas=2, startup_timeout_s=900
    )
    env = driver_env()["env_vars"] | {"MALLOC_MMAP_THRESHOLD_": "65536"}
    engine = start_vllm(
        cfg,
        str(model_dir),
        tmp_path_factory.mktemp("vllm-servers"),
        eos_token_ids=[1],
        dtype="float32",
        seed=0,
        place=ray_placement(lambda i: {"num_cpus": 0.25, "runtime_env": {"env_vars": env}}),
        lora_rank=8,
    )
    yield engine
    engine.close()


def _overrides(cell: tuple[str, ...], urls: list[str]) -> list[str]:
    engine, tuning, advantage, loop, policies = cell
    out = [f"loop.mode={loop}", f"algo.advantage={advantage}", f"engine.type={engine}"]
    if tuning == "lora":
        out += ["lora.enabled=true", "lora.rank=4", "train.lr=1e-2"]
        if cell == ADAPTER_CELL:
            out.append("lora.sync=adapter")
    if engine == "vllm":
        out += ["engine.max_model_len=256", f"engine.urls=[{','.join(urls)}]"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS, ids=["-".join(c) for c in CELLS])
def test_cell_runs_three_steps_on_ray_with_engines_holding_the_trainers_weights(
    cell, ray_local, model_dir, request, tmp_path
):
    engine = request.getfixturevalue("servers") if cell[0] == "vllm" else None
    urls = [r.url for r in engine.replicas] if engine is not None else []
    config = {**BASE, **(SEPARATE if cell[4] == "separate" else {})}
    config["model"] = {**BASE["model"], "path": str(model_dir)}
    result = weir.run(
        config,
        [f"run.dir={tmp_path}", *RAY, *_overrides(cell, urls)],
        reward=None if cell[4] == "separate" else _first_of_group,
    )
    steps = [h for h in result.history if "train/loss" in h or "critic/value_loss" in h]
    assert len(steps) == 3, [sorted(h) for h in result.history]
    for h in steps:
        assert h["sync/verified"] == 1.0 and h["sync/mb"] > 0  # every engine == the trainer
        assert h["cluster/engine_retries"] == 0
        if cell[2] == "gae":
            assert "critic/value_loss" in h
        if cell[4] == "separate":
            assert h["train/a/samples"] > 0
    assert [h["version"] for h in result.history if "sync/verified" in h] == [1.0, 2.0, 3.0]
    if cell[1] == "lora" and cell[0] == "vllm":  # bytes per sync, merged weights or the adapter
        roles = 2 if cell[4] == "separate" else 1
        model = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        hidden, inter, layers = 256, 512, 4  # model_dir's shape; kv heads 2 x head_dim 64 = 128
        adapter = layers * 4 * (2 * (hidden + hidden) + 2 * (hidden + 128) + 3 * (hidden + inter))
        want = roles * (adapter if cell == ADAPTER_CELL else model) * 4 / 2**20
        print(
            f"{'-'.join(cell)}: sync/mb {steps[-1]['sync/mb']:.3f} (model {model * 4 / 2**20:.2f})"
        )
        assert steps[-1]["sync/mb"] == pytest.approx(want, rel=0.01)


# -- a sharded resume on Ray with vLLM ----------------------------------------------------------------


def _metrics(run_dir) -> list[dict]:
    """Every step's metrics without wall-clock figures (those differ between any two runs)."""

    def timing(key: str) -> bool:
        return key.startswith(("time/", "throughput/")) or key.endswith(("_s", "/time"))

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if not timing(k)} for x in lines]


def _rounding(key: str, a, b) -> bool:
    """vLLM's log-probs against the trainer's differ by ~1e-7 between any two runs (a server's
    batches form as the requests arrive); every other metric is exact."""
    return key.startswith("mismatch/") and a is not None and b is not None and abs(a - b) < 1e-6


@pytest.mark.slow
@pytest.mark.heavy  # CI: tests/cluster/test_sharded_resume_on_ray.py (torch engines), the cells above
def test_sharded_resume_on_ray_with_vllm_matches_the_uninterrupted_run(
    servers, model_dir, tmp_path, monkeypatch
):
    from weir.cluster import TrainerFailed
    from weir.train.distributed import TrainerGroup

    config = {
        **BASE,
        "run": {**BASE["run"], "steps": 2, "checkpoint_every": 1},
        "model": {**BASE["model"], "path": str(model_dir)},
    }
    over = [*RAY, "engine.type=vllm", "engine.max_model_len=256"]
    over.append(f"engine.urls=[{servers.replicas[0].url}]")
    weir.run(config, [f"run.dir={tmp_path / 'reference'}", *over], reward=_first_of_group)
    expected = _metrics(tmp_path / "reference")

    train, calls = TrainerGroup.train, []

    def kill_rank1_at_step_2(self, batch, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # after step 1's checkpoint, as step 2 trains
            import ray

            os.kill(ray.get(self.ranks[1].pid.remote()), signal.SIGKILL)
        return train(self, batch, **kwargs)

    killed = tmp_path / "killed"
    monkeypatch.setattr(TrainerGroup, "train", kill_rank1_at_step_2)
    with pytest.raises(TrainerFailed, match="trainer rank 1 died"):
        weir.run(config, [f"run.dir={killed}", *over], reward=_first_of_group)
    monkeypatch.setattr(TrainerGroup, "train", train)
    weir.run(config, [f"run.dir={killed}", *over], reward=_first_of_group)
    got = _metrics(killed)
    assert [x["step"] for x in got] == [0, 1, 2]
    diff = [
        (x["step"], k, x.get(k), y.get(k))
        for x, y in zip(expected, got, strict=True)
        for k in sorted(x.keys() | y.keys())
        if x.get(k) != y.get(k) and not _rounding(k, x.get(k), y.get(k))
    ]
    assert not diff, diff[:20]


# -- what a sync into a vLLM server costs in memory ---------------------------------------------------

MB = 2**20


@pytest.mark.slow
def test_a_sync_into_vllm_holds_one_bucket_not_the_model(servers, model_dir, tmp_path):
    """Two trainer ranks stream 1 MB buckets into a vLLM server: trainer rank 0's and the vLLM
    worker's resident memory rise by about a bucket during a sync (the old full gather: the
    model)."""
    import ray

    from tests.sync.test_sharded_sync import MeasuredCluster, _memory_rise
    from tests.toy import toy_groups
    from weir.config import build_config
    from weir.engine.server_engine import ServerEngine
    from weir.engine.servers import Replica
    from weir.engine.vllm_engine import VllmBackend
    from weir.sync.endpoints import SyncTrainerRank
    from weir.sync.server_sync import ServerSync
    from weir.train.batch import make_batch
    from weir.train.distributed import RankSettings, TrainerGroup

    cfg = build_config({}, [*RAY[:5], "rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-2"])
    cluster = MeasuredCluster(cfg.cluster).start()
    url = servers.replicas[1].url
    engine = ServerEngine(
        VllmBackend(),
        [Replica(url)],
        eos_token_ids=[1],
        max_model_len=256,
        weights_dir=tmp_path / "weights",
        watch_s=0,
    )
    try:
        trainer = TrainerGroup(
            cluster, RankSettings.from_config(cfg), str(model_dir), rank_cls=SyncTrainerRank
        )
        sync = ServerSync(trainer, engine, bucket_mb=1, dtype="float32", verify=True)
        metas = ray.get(trainer.rank0.layout.remote("float32"))
        model_bytes, largest = sum(m.nbytes for m in metas), max(m.nbytes for m in metas)
        assert model_bytes > 8 * MB and largest < MB
        trainer.train(make_batch(toy_groups(), version=0))
        assert sync.push(1)["sync/verified"] == 1.0  # forms the group; the server == the shards

        def worker_rise(call) -> int:
            backend, client = engine.backend, engine._client
            engine.run(backend.reset_memory_peak(client, url))
            before = engine.run(backend.memory(client, url))[0]["rss"]
            call()
            return engine.run(backend.memory(client, url))[0]["peak"] - before

        rank0 = [0]

        def push() -> None:
            rank0[0] = _memory_rise([trainer.rank0], lambda: sync.push(2))[0]

        server = worker_rise(push)
        full = _memory_rise(
            [trainer.rank0], lambda: (trainer.call("gather"), trainer.call("release"))
        )
        # the disk transport for comparison: rank 0 gathers the model, the worker reads it whole
        disk = ServerSync(
            trainer,
            engine,
            "disk",
            disk_dir=tmp_path / "disk",
            model_dir=model_dir,
            dtype="float32",
            verify=True,
        )
        from_disk = worker_rise(lambda: disk.push(3))
        print(
            f"model {model_bytes / MB:.1f} MB, bucket 1 MB: rank 0 +{rank0[0] / MB:.1f} MB, vLLM "
            f"worker +{server / MB:.1f} MB during a streamed sync; the disk transport: rank 0 "
            f"+{full[0] / MB:.1f} MB (full gather), vLLM worker +{from_disk / MB:.1f} MB"
        )
        assert full[0] > 0.9 * model_bytes and from_disk > 0.9 * model_bytes
        assert rank0[0] < MB + largest + 2 * MB  # its shards, one bucket and one tensor
        # the worker: a bucket and vLLM's reload of the layers it is filling (vLLM materialises a
        # layer again and, on CPU, repacks it for its kernels), well below a copy of the model
        assert server < 0.75 * model_bytes and server < from_disk - 2 * MB
        assert sync.push(4)["sync/verified"] == 1.0
        trainer.shutdown()
    finally:
        engine.close()
        cluster.shutdown()


@pytest.mark.slow
def test_one_process_with_vllm_runs_separate_policies_with_lora_adapters(
    servers, model_dir, tmp_path
):
    """The same features with `cluster.type=local` (the degenerate placement): a policy per role
    in this process, each with LoRA adapters that alone go to its own vLLM server (the module's two,
    split between the roles by `engine.urls`); the servers' log-probs under the adapters match
    the trainer's."""
    urls = ",".join(r.url for r in servers.replicas)
    config = {**BASE, **SEPARATE, "model": {**BASE["model"], "path": str(model_dir)}}
    result = weir.run(
        config,
        [
            f"run.dir={tmp_path}",
            "run.steps=2",
            "engine.type=vllm",
            "engine.max_model_len=256",
            f"engine.urls=[{urls}]",
            "lora.enabled=true",
            "lora.rank=4",
            "lora.sync=adapter",
            "train.lr=1e-2",
        ],
    )
    steps = [h for h in result.history if "train/loss" in h]
    assert len(steps) == 2 and all(h["train/a/samples"] > 0 for h in steps)
    assert all(0 < h["sync/mb"] < 1.0 for h in steps)  # two adapters of 0.25 MB, not the model
    assert all(h["mismatch/abs_logp_diff"] < 2e-4 for h in steps if "mismatch/abs_logp_diff" in h)


# -- a server that dies while the weights travel -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.heavy  # CI: tests/engine/test_sglang_adapter.py (the same ServerSync, servers faked)
def test_a_vllm_server_killed_during_a_weight_broadcast_costs_the_update_nothing(
    servers, model_dir, tmp_path, monkeypatch
):
    """Two trainer ranks stream 64 KB buckets to the module's two vLLM servers; one is killed
    (SIGKILL, its process group) while it receives. The sync aborts the group, the update goes
    again to the survivor, whose weights are then the trainer's exactly (the digest of what it
    loaded, after a first load that broke off half way); the killed server restarts, gets the
    current weights streamed from the shards, and the next push lands on both, checked the same
    way. Then the same server is stopped (SIGSTOP: a host gone without a TCP reset) as a new
    group forms: its unanswered /health checks abort the forming group, the other server's
    worker extension leaves the rendezvous (so only the stopped one restarts), and the update
    lands on the other. Runs last in the module: it restarts a server of the module's fixture."""
    import threading
    import time

    from tests.toy import toy_groups
    from weir.cluster.ray_cluster import RayCluster
    from weir.config import build_config
    from weir.sync.endpoints import SyncTrainerRank
    from weir.sync.server_sync import ServerSync
    from weir.train.batch import make_batch
    from weir.train.distributed import RankSettings, TrainerGroup

    cfg = build_config({}, [*RAY[:5], "rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-2"])
    cluster = RayCluster(cfg.cluster).start()
    trainer = TrainerGroup(
        cluster, RankSettings.from_config(cfg), str(model_dir), rank_cls=SyncTrainerRank
    )
    sync = ServerSync(trainer, servers, bucket_mb=1 / 16, dtype="float32", verify=True)
    backend, receive = servers.backend, servers.backend.receive_broadcast
    victim = servers.replicas[1]
    kills: list[float] = []

    async def receive_and_die(client, url, buckets, name, digest=False):
        if url == victim.url and kills and kills[-1] >= 0:
            pid, delay = victim.process.pid, kills[-1]

            def kill() -> None:
                time.sleep(delay)
                os.killpg(pid, signal.SIGKILL)

            threading.Thread(target=kill, daemon=True).start()
            kills.append(-1.0)  # once per push
        await receive(client, url, buckets, name, digest)

    try:
        assert sync.push(1)["sync/verified"] == 1.0  # forms the group of both
        trainer.train(make_batch(toy_groups(), version=0))
        start = time.perf_counter()
        assert sync.push(2)["sync/verified"] == 1.0
        clean_s = time.perf_counter() - start
        backend.receive_broadcast = receive_and_die
        version, got = 2, None
        for fraction in (0.3, 0.1, 0.0):  # the kill must land while the buckets travel
            trainer.train(make_batch(toy_groups(), version=version))
            version += 1
            before = servers.update_retries
            kills.append(fraction * clean_s)
            got = sync.push(version)
            if servers.update_retries > before:
                break
            assert servers.wait_healthy(600), "the killed server did not come back"
        assert servers.update_retries > before, f"no kill landed during a push ({clean_s:.2f} s)"
        assert got["sync/verified"] == 1.0 and servers.healthy == [True, False]
        assert got["cluster/sync_retries"] >= 1
        assert got["time/sync"] < 60  # the aborted group let go at once, not at gloo's 600 s
        backend.receive_broadcast = receive
        assert servers.wait_healthy(600), "the killed server did not come back"
        assert servers.version == version and servers.restarts >= 1
        trainer.train(make_batch(toy_groups(), version=version))
        assert sync.push(version + 1)["sync/verified"] == 1.0 and all(servers.healthy)
        assert len(sync.digests()) == 2
        print(
            f"clean push {clean_s:.2f} s; killed {kills[-2]:.2f} s into push {version}, which "
            f"took {got['time/sync']:.2f} s: {servers.update_retries} update retries, "
            f"{servers.restarts} restarts"
        )

        import weir.sync.server_sync as server_sync

        monkeypatch.setattr(server_sync, "LIVENESS_PERIOD_S", 2.0)  # a loaded CPU answers late
        monkeypatch.setattr(server_sync, "LIVENESS_MISSES", 3)
        monkeypatch.setattr(server_sync, "ABORT_GRACE_S", 10.0)

        async def join_and_stop(client, url, *args):
            if url == victim.url:
                os.killpg(victim.process.pid, signal.SIGSTOP)
            return await init(client, url, *args)

        init = backend.init_broadcast
        backend.init_broadcast = join_and_stop
        try:
            sync._members = None  # as after a restart: the next push forms a new group
            retries, restarts = servers.update_retries, servers.restarts
            trainer.train(make_batch(toy_groups(), version=version + 1))
            got = sync.push(version + 2)
        finally:
            backend.init_broadcast = init
        assert got["sync/verified"] == 1.0 and servers.healthy == [True, False]
        assert servers.update_retries == retries + 1 and got["time/sync"] < 60
        assert servers.wait_healthy(600), "the stopped server did not come back"
        assert servers.restarts == restarts + 1  # the other left the rendezvous: not wedged
        assert servers.version == version + 2
        print(f"a server stopped as its group formed: the push took {got['time/sync']:.2f} s")
    finally:
        backend.receive_broadcast = receive
        trainer.shutdown()
        cluster.shutdown()
