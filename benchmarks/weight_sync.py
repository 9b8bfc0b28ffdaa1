"""Weight sync: time and throughput of each transport, trainer -> engines, on a local Ray cluster.

For each model size, 2 FSDP2 trainer ranks and 2 engine replicas run as Ray actors; every push
delivers the weights to both replicas with one transport: broadcast (streamed from the shards
bucket by bucket over a gloo group), handles (the same stream, colocated: shared-memory handles),
disk via safetensors and Ray's object store (these two gather the full weights on rank 0). The
rise of rank 0's resident memory during a push is reported too (glibc's heap may hide part of it:
see docs/distributed.md). The in-process transport
(one process, the engine on its own copy of the model) is timed for comparison. After every push
the replicas' weights are hashed and compared with the trainer's.

Reported per transport: median total sync time, median delivery time (after the gather), MB per
push and delivery MB/s (MB / delivery time; for 2 replicas twice that many bytes move).

    python benchmarks/weight_sync.py                   # tiny and small, 3 pushes each
    python benchmarks/weight_sync.py --sizes small --pushes 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def bench_ray(
    size: str, model_dir: str, pushes: int, root: Path, colocate: bool = False
) -> list[dict]:
    import ray

    from weir.config import build_config
    from weir.loop.ray_build import build_ray
    from weir.sync.coordinator import WeightSync

    cfg = build_config(
        {"data": {"task": "arithmetic"}},
        [
            "cluster.type=ray",
            "cluster.trainer.ranks=2",
            "cluster.engines.replicas=2",
            "cluster.trainer.cpus_per_rank=0.5",
            "cluster.engines.cpus=0.5",
            f"cluster.colocate={colocate}",
        ],
    )
    parts = build_ray(cfg, root, model_dir)
    rank0 = parts.trainer.rank0
    rows = []
    version = 0
    try:
        for transport in ("broadcast",) if colocate else ("broadcast", "disk", "object_store"):
            sync = WeightSync(
                parts.trainer,
                parts.router,
                transport,
                disk_dir=root / "weights",
                bucket_mb=64,
                host_handles=colocate,
            )
            sync.push(version := version + 1)  # warm-up (forms the broadcast group once)
            times, deliver, rise = [], [], []
            for _ in range(pushes):
                ray.get(rank0.reset_memory_peak.remote())
                before = ray.get(rank0.memory.remote())["rss"]
                stats = sync.push(version := version + 1)
                rise.append((ray.get(rank0.memory.remote())["peak"] - before) / 2**20)
                times.append(stats["time/sync"])
                deliver.append(stats["sync/deliver_s"])
                want = parts.trainer.call("weights_hash")[0]
                got = ray.get([r.weights_hash.remote() for r in parts.router.replicas])
                assert got == [want] * len(got), f"{transport}: engine weights differ"
            mb = stats["sync/mb"]
            name = "handles" if colocate else transport
            rows.append({**_row(size, name, mb, times, deliver), "rank0_rise_mb": max(rise)})
    finally:
        parts.shutdown()
    return rows


def bench_in_process(size: str, model_dir: str, pushes: int) -> dict:
    import copy

    from weir.engine.torch_engine import TorchEngine
    from weir.sync import push_in_process, weights_hash
    from weir.train.model import eos_token_ids, load_model

    model, tok = load_model(model_dir)
    engine = TorchEngine(
        copy.deepcopy(model), eos_token_ids=eos_token_ids(model, tok), pad_token_id=0
    )
    try:
        times = []
        for v in range(pushes):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            t = time.perf_counter()
            push_in_process(engine, model.named_parameters(), v + 1)
            times.append(time.perf_counter() - t)
            assert weights_hash(engine.model.state_dict()) == weights_hash(model.state_dict())
        mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    finally:
        engine.close()
    return _row(size, "in_process", mb, times, times)


def _row(size: str, transport: str, mb: float, times: list, deliver: list) -> dict:
    d = statistics.median(deliver)
    return {
        "size": size,
        "transport": transport,
        "mb": mb,
        "sync_s": statistics.median(times),
        "deliver_s": d,
        "mb_per_s": mb / d if d > 0 else float("inf"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray")
    args = ap.parse_args()
    import ray

    from weir.tasks.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model_dir = str(build_tiny_model(Path(tmp) / size, size=size, seed=0))
            rows.append(bench_in_process(size, model_dir, args.pushes))
            rows += bench_ray(size, model_dir, args.pushes, Path(tmp) / f"run-{size}")
            rows += bench_ray(size, model_dir, args.pushes, Path(tmp) / f"co-{size}", True)
    ray.shutdown()
    print(
        f"{'size':6} {'transport':13} {'MB':>8} {'sync s':>8} {'deliver s':>10} {'MB/s':>9} "
        f"{'rank 0 +MB':>10}"
    )
    for r in rows:
        rise = r.get("rank0_rise_mb")
        print(
            f"{r['size']:6} {r['transport']:13} {r['mb']:8.2f} {r['sync_s']:8.3f} "
            f"{r['deliver_s']:10.3f} {r['mb_per_s']:9.1f} "
            f"{'' if rise is None else f'{rise:10.1f}'}"
        )


if __name__ == "__main__":
    main()
