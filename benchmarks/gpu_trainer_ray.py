"""The colocated Ray step against the local one, and the weight sync's seconds per GB
(`benchmarks/gpu_trainer.py --ray`).

One model (the 0.5B shape on a GPU, `tiny` on a CPU; weir's byte tokenizer, the shape's own
vocabulary), the lognormal batch of gpu_trainer.py's main part, the same train config three ways,
each with `--warmup` untimed warm-up steps and `--steps` timed ones:

- local: weir's `Actor` in this process (what `cluster.type=local` runs);
- one FSDP2 rank: `ShardedActor` on a process group of one in this process: FSDP2's own cost,
  without Ray or offload (what each rank of a larger group pays; a group of one no longer runs it);
- ray: `cluster.type=ray` with `cluster.colocate=true` (trainer rank and engine on the one device,
  the engine asleep with its weights parked while the trainer trains). A group of one rank trains
  the plain `Actor` (weir.train.distributed.shards_model; `rank_sharded` says which ran). Per step
  the driver's wall time of the engine's sleep, `trainer.train` and the engine's wake (what the
  loop waits for), split into the sleep, the rank's onload of parameters and AdamW state, its step,
  its offload of the AdamW state (`time/onload`, `time/train`, `time/offload`), the wake, and what
  is left (Ray's call, the batch's pickling); then a weight sync in bfloat16 by memory handle:
  seconds per GB of its delivery (`sync/deliver_s`) and of the whole sync with the parameters'
  offload after it.

Local and one FSDP2 rank each also run one step with the device synchronised around its phases
(`split`: forwards and backwards, the rest of the updates, the rest of the step;
gpu_timing.phase_split), and report the layout they ran (after the steps) with `auto`'s candidates.

The targets of issue 35: the Ray step (driver wall) within 1.2x of the local one, the sync's
delivery at most 0.1 s/GB.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpu_timing import free, phase_split, timed
from gpu_trainer import MICRO_BATCH, SHAPES, layout_report, liger_in_process, make_groups


def _save_model(shape: str, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from weir.tasks.tiny_model import build_tokenizer

    tok = build_tokenizer()
    config = Qwen2Config(
        **SHAPES[shape],
        max_position_embeddings=8192,
        rope_theta=1e6,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    return out


def _overrides(args, shape: str, device: torch.device, batch, ray: bool) -> list[str]:
    longest = max(batch.response_lengths)
    cfg = [
        f"rollout.batch_prompts={args.prompts}",
        f"rollout.n={args.n}",
        f"rollout.max_new_tokens={longest}",
        "train.lr=1e-6",
        f"train.micro_batch_tokens={args.micro_batch_tokens or MICRO_BATCH[shape]}",
        "train.gradient_checkpointing=false",
        f"train.compute_dtype={'bfloat16' if device.type == 'cuda' else 'float32'}",
        "algo.old_logprobs=recompute",
        "telemetry.console=false",
    ]
    if device.type != "cuda":
        cfg += ["train.device=cpu", "engine.device=cpu"]
    if ray:
        gpu = device.type == "cuda"
        cfg += [
            "cluster.type=ray",
            "cluster.colocate=true",
            f"cluster.trainer.gpus_per_rank={1 if gpu else 0}",
            f"cluster.engines.gpus={0.5 if gpu else 0}",
            "cluster.trainer.cpus_per_rank=1",
            "cluster.engines.cpus=1",
            "engine.sleep_offload_weights=true",
            "engine.kv_idle_release_s=null",
        ]
    return cfg


# further colocated configurations than the full hand-over above (`--ray-modes`): `defaults` the
# engine frees its KV cache but keeps its weights (engine.sleep_offload_weights=false, the default),
# the trainer still offloads; `resident` nothing moves (both fit on the device); and FSDP_COMPILE
FSDP_COMPILE = "fsdp_compile"
"""A further `--ray-modes` entry, not a Ray run: the one-rank FSDP2 step with `train.fuse=compile`
(`auto` leaves an FSDP2 rank unfused until this is measured faster; the one H100 comparison ran
its compiled layers uncompiled, weir.train.fuse._compile_layer)."""
RAY_MODES = {
    "defaults": ["engine.sleep_offload_weights=false"],
    "resident": [
        "engine.sleep_offload_weights=false",
        "cluster.offload_trainer=false",
        "engine.sleep_while_training=false",
    ],
}


def _steps(actor, batch, device, steps: int, budget: int, warmup: int) -> dict[str, Any]:
    warm = [timed(actor, batch, device)[0] for _ in range(warmup)]
    runs = [timed(actor, batch, device)[0] for _ in range(steps)]
    out = {"warmup_s": warm, "step_s": runs, "mean_s": statistics.mean(runs)}
    out["split"] = phase_split(actor, batch, device)
    out.update(layout_report(actor, batch, budget))  # after the steps: chosen per step
    out["liger_in_process"] = liger_in_process()
    return out


def _local(
    model_dir: Path, cfg, batch, device, steps: int, warmup: int, *, sharded: bool
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from weir.train.actor import Actor, ActorSettings

    # each contender compiles the fused head for itself: in the H200 run the FSDP2 rank, after the
    # local actor in this process, hit dynamo's recompile limit and ran the head eagerly
    torch._dynamo.reset()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    settings = ActorSettings.from_config(cfg)
    budget = cfg.train.micro_batch_tokens
    if not sharded:
        actor = Actor(model, settings)
        try:
            return _steps(actor, batch, device, steps, budget, warmup)
        finally:
            del actor, model
            free(device)
    import torch.distributed as dist

    from weir.train.distributed import free_port
    from weir.train.sharded_actor import ShardedActor

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        actor = ShardedActor(model, settings)
        return _steps(actor, batch, device, steps, budget, warmup)
    finally:
        actor = model = None
        dist.destroy_process_group()
        free(device)


def _ray(model_dir: Path, cfg, batch, steps: int, warmup: int, run_dir: Path) -> dict[str, Any]:
    from weir.loop.ray_build import build_ray

    parts = build_ray(cfg, run_dir, str(model_dir))
    router = parts.router
    rows: list[dict[str, float]] = []
    try:
        start = parts.trainer.start_stats()[0]
        for step in range(warmup + steps):  # warm-ups first (CUDA, cuBLAS, the first offload)
            t0 = time.perf_counter()
            # what the loop's `router.asleep(update_follows=True)` does around the step, timed apart
            if router.sleep_mode:
                router.sleep_sync(router.sleep_offload_weights)
            t1 = time.perf_counter()
            try:
                stats = parts.trainer.train(batch)
            finally:
                t2 = time.perf_counter()
                if router.sleep_mode:  # the sync below writes the weights (no copy back)
                    router.wake_sync(update_follows=True)
            t3 = time.perf_counter()
            sync = parts.sync.push(step + 1)
            row = {
                "wall_s": t3 - t0,
                "sleep_s": t1 - t0,
                "rank_call_s": t2 - t1,
                "wake_s": t3 - t2,
                "train_s": stats.get("time/train", float("nan")),
                "onload_s": stats.get("time/onload", 0.0),
                "offload_s": stats.get("time/offload", 0.0),
                "sync_s": sync["time/sync"],
                "sync_deliver_s": sync["sync/deliver_s"],
                "sync_offload_s": sync.get("sync/offload_s", 0.0),
                "sync_gb": sync["sync/mb"] / 1024,
            }
            # Ray's call around the rank's own work: the batch's pickling, the transfer, the reply
            row["call_s"] = row["rank_call_s"] - row["onload_s"] - row["train_s"] - row["offload_s"]
            rows.append(row)
            print("ray step:", {k: round(v, 4) for k, v in row.items()}, flush=True)
    finally:
        parts.shutdown()
    sharded = bool(start.get("sharded", 1.0))
    return {"rank_sharded": sharded, "warmup": rows[:warmup], "steps": rows[warmup:]}


def measure(args, device: torch.device, seconds: float) -> dict[str, Any]:
    """The three runs above within about `seconds`; what did not fit is marked skipped."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return {"skipped": "ray is not installed here"}
    from weir.config import build_config
    from weir.train.batch import make_batch

    start = time.perf_counter()
    shape = "0.5b" if device.type == "cuda" else "tiny"
    steps, warm = args.steps, max(1, getattr(args, "warmup", 1))
    out: dict[str, Any] = {"shape": shape}
    with tempfile.TemporaryDirectory(prefix="weir-gpu-trainer-ray-") as tmp:
        model_dir = _save_model(shape, Path(tmp) / "model")
        batch = make_batch(make_groups(args, SHAPES[shape]["vocab_size"], "lognormal"), version=0)
        out["tokens"] = sum(len(s) for s in batch.sequences)
        local_cfg = build_config({}, _overrides(args, shape, device, batch, ray=False))
        out["local"] = _local(model_dir, local_cfg, batch, device, steps, warm, sharded=False)
        print("local:", out["local"], flush=True)
        if time.perf_counter() - start < seconds / 3:
            try:
                out["fsdp_one_rank"] = _local(
                    model_dir, local_cfg, batch, device, steps, warm, sharded=True
                )
            except Exception as err:  # noqa: BLE001 - a diagnostic: report and go on
                out["fsdp_one_rank"] = {"error": f"{type(err).__name__}: {err}"[:300]}
            print("one FSDP2 rank:", out["fsdp_one_rank"], flush=True)
        gc.collect()
        ray_cfg = build_config({}, _overrides(args, shape, device, batch, ray=True))
        out["ray"] = _ray(model_dir, ray_cfg, batch, steps, warm, Path(tmp) / "run")
        for mode in [m for m in getattr(args, "ray_modes", "").split(",") if m]:
            if time.perf_counter() - start > seconds * 0.7:
                out[f"ray_{mode}"] = {"skipped": "budget"}
                continue
            if mode == FSDP_COMPILE:  # not a Ray run: the one-rank FSDP2 step, layers compiled
                cfg = _overrides(args, shape, device, batch, ray=False) + ["train.fuse=compile"]
                try:
                    row = _local(
                        model_dir, build_config({}, cfg), batch, device, steps, warm, sharded=True
                    )
                except Exception as err:  # noqa: BLE001 - a diagnostic: report and go on
                    row = {"error": f"{type(err).__name__}: {err}"[:300]}
                out[mode] = row
                print(f"{mode}:", row, flush=True)
                continue
            cfg = _overrides(args, shape, device, batch, ray=True) + RAY_MODES[mode]
            try:
                rows = _ray(model_dir, build_config({}, cfg), batch, steps, warm, Path(tmp) / mode)
            except Exception as err:  # noqa: BLE001 - a further figure: report and go on
                out[f"ray_{mode}"] = {"error": f"{type(err).__name__}: {err}"[:300]}
                continue
            out[f"ray_{mode}"] = rows
            wall = statistics.mean(r["wall_s"] for r in rows["steps"])
            out[f"ray_{mode}_over_local"] = wall / out["local"]["mean_s"]
    timed_rows = out["ray"]["steps"]
    local = out["local"]["mean_s"]
    wall = statistics.mean(r["wall_s"] for r in timed_rows)
    out["ray_over_local"] = wall / local
    out["ray_rank_train_over_local"] = statistics.mean(r["train_s"] for r in timed_rows) / local
    # where the Ray step's time goes beyond the local step's (means over the timed steps)
    parts = ("sleep_s", "onload_s", "train_s", "offload_s", "wake_s", "call_s")
    out["ray_split_s"] = {k: statistics.mean(r[k] for r in timed_rows) for k in parts}
    out["ray_split_s"]["local_step_s"] = local
    out["ray_call_overhead_s"] = out["ray_split_s"]["call_s"]
    per_gb = sorted(r["sync_deliver_s"] / r["sync_gb"] for r in timed_rows)
    out["sync_s_per_gb"] = statistics.median(per_gb)
    out["sync_s_per_gb_runs"] = per_gb
    out["sync_with_offload_s_per_gb"] = statistics.median(
        r["sync_s"] / r["sync_gb"] for r in timed_rows
    )
    if "fsdp_one_rank" in out and "mean_s" in out["fsdp_one_rank"]:
        out["fsdp_one_rank_over_local"] = out["fsdp_one_rank"]["mean_s"] / local
    return out
