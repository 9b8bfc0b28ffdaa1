"""One RL step at real model sizes on one GPU: engine decode, trainer throughput and MFU, memory.

Random-init models with the shapes of Qwen2.5-0.5B and Qwen2.5-1.5B (no download), float32 master
weights with bfloat16 compute, a bfloat16 engine:

- engine decode tokens/s (weir's TorchEngine, continuous batching) against HF `generate` on the
  same GPU and the same prompts;
- trainer tokens/s and MFU of one cold step on the generated samples (GRPO loss, activation
  checkpointing, the `train.packing` layout): 6ND and model-FLOP MFU as benchmarks/gpu_trainer.py
  defines them. That script is the trainer's benchmark (warm-up, CUDA events, layouts,
  realistic lengths, profile); this one times the step as the loop's first step runs it;
- peak GPU memory of each phase and the step's time split (generate, train, weight sync);
- optionally `--grpo-steps N`: N GRPO steps of the full weir loop (`weir.run`) with the 0.5B
  shape locally, and on Ray (one GPU, colocated: trainer offloaded while the engine generates, the
  engine asleep while the trainer trains, weights by CUDA IPC; sync seconds per GB reported) with
  `--ray`.

    python benchmarks/gpu_step.py                        # both shapes, 256 prompts x 8 x 512
    python benchmarks/gpu_step.py --quick                # 32 prompts x 8 x 128: a smoke run
    python benchmarks/gpu_step.py --grpo-steps 20 --ray  # plus the loop, locally and on Ray
    python benchmarks/gpu_step.py --quick --compare-cudnn # engine with cuDNN attention off vs on
    python benchmarks/gpu_step.py --quick --compare-graphs # engine with CUDA graphs off vs on
    python benchmarks/gpu_step.py --device cpu --shapes tiny --quick   # code path check, no GPU

Writes a JSON of every figure to --out (default gpu_step.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from model_shapes import QWEN25, SMALL  # benchmarks/model_shapes.py (the script's folder)
from transformers import AutoModelForCausalLM, Qwen2Config

SHAPES: dict[str, dict[str, Any]] = {
    **{k: QWEN25[k] for k in ("0.5b", "1.5b")},
    "tiny": {
        **SMALL["tiny"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 1024,
        "tie_word_embeddings": True,
    },  # checks the code path on a CPU
}

# dense bf16 tensor-core peak, FLOP/s
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def build(shape: str, device: torch.device, attn: str) -> torch.nn.Module:
    config = Qwen2Config(
        **SHAPES[shape],
        max_position_embeddings=4096,
        rope_theta=1e6,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    return model.to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def engine_decode(model, device, batch, n, new_tokens, max_rows, cuda_graphs=True):
    """Decode with weir's engine in bf16; returns (completions, figures)."""
    import copy

    from weir.engine.base import SamplingParams
    from weir.engine.torch_engine import TorchEngine

    engine_model = copy.deepcopy(model).to(torch.bfloat16).eval()
    reset_peak(device)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new_tokens, seed=1)
    with TorchEngine(
        engine_model,
        eos_token_ids=[0],
        pad_token_id=0,
        max_batch_size=max_rows,
        seed=0,
        cuda_graphs=cuda_graphs,
    ) as engine:
        engine.generate_many(batch[:2], SamplingParams(n=1, max_new_tokens=4))  # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = engine.generate_many(batch, params)
        sync(device)
        wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        engine.update_weights_sync(model.named_parameters(), version=1)  # fp32 -> bf16 cast
        sync(device)
        sync_s = time.perf_counter() - t1
        stats = engine.stats()
    tokens = sum(len(c.token_ids) for comps in out for c in comps)
    figures = {
        "engine_tokens": tokens,
        "engine_s": wall,
        "engine_tok_s": tokens / wall,
        "engine_peak_gb": peak_gb(device),
        "weight_sync_s": sync_s,
        "decode_steps": stats["decode_steps"],
        "decode_graphs": stats["decode_graphs"],
        "decode_fixed_shape": stats["decode_fixed_shape"],
    }
    del engine_model
    return out, figures


def cudnn_comparison(model, device, batch, args) -> dict[str, Any]:
    """Engine decode tokens/s with cuDNN's SDPA backend off and on, alternating, twice each: torch
    sends masked attention to cuDNN first on Hopper, and cuDNN plans per shape (weir.config.devices
    .set_cudnn_attention)."""
    from weir.config.devices import set_cudnn_attention

    runs: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(2):
        for mode in ("off", "on"):
            set_cudnn_attention(device, mode == "on")
            _, figures = engine_decode(model, device, batch, args.n, args.new_tokens, args.max_rows)
            runs[mode].append(figures["engine_tok_s"])
    set_cudnn_attention(device, args.cudnn_attention)
    best = {k: max(v) for k, v in runs.items()}
    return {"cudnn_comparison": {**runs, "off_over_on": best["off"] / best["on"]}}


def graphs_comparison(model, device, batch, args) -> dict[str, Any]:
    """Engine decode tokens/s with CUDA graphs off and on (engine.cuda_graphs), alternating, twice
    each; with whether the graphs stayed on (their first step is checked against the eager one)."""
    runs: dict[str, list[float]] = {"eager": [], "graphs": []}
    kept = []
    for _ in range(2):
        for mode in ("eager", "graphs"):
            _, figures = engine_decode(
                model, device, batch, args.n, args.new_tokens, args.max_rows, mode == "graphs"
            )
            runs[mode].append(figures["engine_tok_s"])
            if mode == "graphs":
                kept.append((figures["decode_fixed_shape"], figures["decode_graphs"]))
    best = {k: max(v) for k, v in runs.items()}
    return {
        "graphs_comparison": {
            **runs,
            "kept_and_captured": kept,
            "graphs_over_eager": best["graphs"] / best["eager"],
        }
    }


def hf_generate(model, device, batch, n, new_tokens, rows_per_call):
    """HF `generate` (sampling, KV cache) in bf16 on the same prompts, in batches of rows."""
    import copy

    m = copy.deepcopy(model).to(torch.bfloat16).eval()
    m.config.use_cache = True
    m.generation_config.pad_token_id = 0
    m.generation_config.eos_token_id = None
    rows = [p for p in batch for _ in range(n)]
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for s in range(0, len(rows), rows_per_call):
            ids = torch.tensor(rows[s : s + rows_per_call], device=device)
            out = m.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
            )
            tokens += (out.shape[1] - ids.shape[1]) * out.shape[0]
    sync(device)
    wall = time.perf_counter() - t0
    del m
    return {
        "hf_tokens": tokens,
        "hf_s": wall,
        "hf_tok_s": tokens / wall,
        "hf_peak_gb": peak_gb(device),
    }


def train_step(model, device, batch, completions, args) -> dict[str, float | None]:
    """One GRPO step of weir's Actor on the generated samples (fp32 masters, bf16 compute)."""
    from weir.config import build_config
    from weir.data.sample import Group, Sample
    from weir.train.actor import Actor, ActorSettings
    from weir.train.batch import make_batch

    groups = []
    g = torch.Generator().manual_seed(2)
    for gid, (prompt, comps) in enumerate(zip(batch, completions, strict=True)):
        rewards = torch.rand(len(comps), generator=g).tolist()
        samples = [
            Sample(
                prompt_ids=prompt,
                response_ids=c.token_ids,
                rollout_logprobs=c.logprobs,
                versions=[0] * len(c.token_ids),
                reward=r,
                group_id=gid,
                index=i,
            )
            for i, (c, r) in enumerate(zip(comps, rewards, strict=True))
        ]
        groups.append(Group(samples=samples, group_id=gid))
    cfg = build_config(
        {},
        [
            f"rollout.batch_prompts={len(batch)}",
            f"rollout.n={args.n}",
            f"rollout.max_new_tokens={args.new_tokens}",
            "train.lr=1e-6",
            f"train.mini_batches={args.mini_batches}",
            f"train.micro_batch_tokens={args.micro_batch_tokens}",
            f"train.gradient_checkpointing={not args.no_checkpointing}",
            f"train.packing={args.packing}",
            "train.compute_dtype=bfloat16"
            if device.type == "cuda"
            else "train.compute_dtype=float32",
            "algo.old_logprobs=recompute",
        ],
    )
    tb = make_batch(groups, version=0)
    actor = Actor(model, ActorSettings.from_config(cfg))
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    stats = actor.train(tb)
    sync(device)
    wall = time.perf_counter() - t0
    tokens = sum(len(s) for s in tb.sequences)
    params = sum(p.numel() for p in model.parameters())
    peak = peak_flops(device)
    from trainer_flops import step_flops  # benchmarks/trainer_flops.py

    flops = step_flops(
        SHAPES[args.shape_name], [len(s) for s in tb.sequences], tb.response_lengths, params
    )
    return {
        "layout": actor.layout,
        "train_tokens": tokens,
        "train_s": wall,
        "train_tok_s": tokens / wall,
        "mfu_6nd": 6 * params * tokens / wall / peak if peak else None,
        "mfu_model": flops["model"] / wall / peak if peak else None,
        "train_peak_gb": peak_gb(device),
        "grad_norm": stats["train/grad_norm"],
        "params": params,
    }


def grpo_run(shape: str, steps: int, device: torch.device, ray: bool, out_dir: Path):
    """`steps` GRPO steps of the whole weir loop on the arithmetic task with a model of `shape`.

    weir's byte tokenizer (a few hundred ids) stands in for Qwen's; the model keeps the shape's
    layers and hidden sizes, its vocabulary is the tokenizer's.
    """
    import weir
    from weir.loop.engine_load import GAUGES
    from weir.tasks.tiny_model import build_tokenizer

    tok = build_tokenizer()
    dims = {**SHAPES[shape], "vocab_size": len(tok)}
    config = Qwen2Config(
        **dims,
        max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model_dir = out_dir / f"model-{shape}"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    overrides = [
        f"model.path={model_dir}",
        f"run.dir={out_dir / ('ray' if ray else 'local')}",
        f"run.steps={steps}",
        "run.eval_every=0",
        "run.save_model=false",
        "run.checkpoint_every=0",
        "rollout.batch_prompts=32",
        "rollout.n=8",
        "rollout.max_new_tokens=64",
        "train.lr=1e-6",
        "train.compute_dtype=bfloat16",
        "train.gradient_checkpointing=true",
        "telemetry.console=false",
        "data.task=arithmetic",
        "data.eval_size=16",
    ]
    if ray:
        overrides += [
            "cluster.type=ray",
            "cluster.trainer.gpus_per_rank=1",
            "cluster.engines.gpus=0.5",
            "cluster.trainer.cpus_per_rank=1",
            "cluster.colocate=true",
            "engine.sleep_offload_weights=true",  # the engine sleeps without its weights too
        ]
    elif device.type != "cuda":
        overrides += ["train.device=cpu"]
    t0 = time.perf_counter()
    result = weir.run({}, overrides)
    wall = time.perf_counter() - t0
    steps_done = [h for h in result.history if "train/grad_norm" in h]
    return {
        "steps": len(steps_done),
        "wall_s": wall,
        "reward_first": steps_done[0].get("reward/mean") if steps_done else None,
        "reward_last": steps_done[-1].get("reward/mean") if steps_done else None,
        "mismatch_abs_logp_diff_max": max(
            (h.get("mismatch/abs_logp_diff", 0.0) for h in steps_done), default=None
        ),
        "decode_path_last": {k: steps_done[-1].get(f"engine/{k}") for k in GAUGES}
        if steps_done
        else None,
        "sync_gb": steps_done[-1].get("sync/mb", 0.0) / 1024 if steps_done else None,
        "sync_s_per_gb": sorted(
            h["time/sync"] / (h["sync/mb"] / 1024) for h in steps_done if h.get("sync/mb")
        ),
        "time_split_mean": {
            k: sum(h[k] for h in steps_done if k in h) / max(1, len(steps_done))
            for k in ("time/generate", "time/train", "time/sync", "time/reward")
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", default="0.5b,1.5b")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--max-rows", type=int, default=1024, help="engine.max_batch_size")
    ap.add_argument("--hf-rows", type=int, default=512, help="rows per HF generate call")
    ap.add_argument("--hf-prompts", type=int, default=64, help="prompts HF generate decodes")
    ap.add_argument("--mini-batches", type=int, default=1)
    ap.add_argument("--micro-batch-tokens", type=int, default=32768)
    ap.add_argument("--packing", default="auto", choices=["auto", "packed", "padded"])
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument(
        "--attn", default="sdpa", help="attn_implementation (flash_attention_2 if installed)"
    )
    ap.add_argument("--grpo-steps", type=int, default=0)
    ap.add_argument("--ray", action="store_true", help="also run the GRPO steps on Ray")
    ap.add_argument("--quick", action="store_true", help="32 prompts x 8 x 128 tokens")
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="let SDPA use cuDNN (model.cudnn_attention; weir's default is off)",
    )
    ap.add_argument(
        "--compare-cudnn",
        action="store_true",
        help="also time the engine with cuDNN attention the other way, alternating",
    )
    ap.add_argument(
        "--compare-graphs",
        action="store_true",
        help="also time the engine with CUDA graphs off and on (engine.cuda_graphs), alternating",
    )
    ap.add_argument("--out", default="gpu_step.json")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.hf_prompts = 32, 128, 16
    from weir.config.devices import enable_tf32, resolve_device, set_cudnn_attention

    device = resolve_device(args.device)
    enable_tf32(device, deterministic=False)
    set_cudnn_attention(device, args.cudnn_attention)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor(),
        "torch": torch.__version__,
        "args": vars(args),
        "shapes": {},
    }
    for shape in args.shapes.split(","):
        model = build(shape, device, args.attn)
        vocab = SHAPES[shape]["vocab_size"]
        batch = prompts(args.prompts, args.prompt_tokens, vocab)
        comps, eng = engine_decode(model, device, batch, args.n, args.new_tokens, args.max_rows)
        hf = hf_generate(
            model, device, batch[: args.hf_prompts], args.n, args.new_tokens, args.hf_rows
        )
        args.shape_name = shape
        tr = train_step(model, device, batch, comps, args)
        row = {**eng, **hf, **tr, "engine_vs_hf": eng["engine_tok_s"] / hf["hf_tok_s"]}
        if args.compare_graphs:
            row.update(graphs_comparison(model, device, batch, args))
            print(f"{shape}: CUDA graphs", row["graphs_comparison"], flush=True)
        if args.compare_cudnn:
            row.update(cudnn_comparison(model, device, batch, args))
            print(f"{shape}: cuDNN attention", row["cudnn_comparison"], flush=True)
        report["shapes"][shape] = row
        mfu = "n/a" if tr["mfu_6nd"] is None else f"{tr['mfu_6nd']:.1%}"
        print(
            f"{shape}: engine {eng['engine_tok_s']:.0f} tok/s ({row['engine_vs_hf']:.1f}x HF "
            f"{hf['hf_tok_s']:.0f}), train {tr['train_tok_s']:.0f} tok/s "
            f"[{tr['layout']}], MFU {mfu}, "
            f"peaks engine {eng['engine_peak_gb']} / train {tr['train_peak_gb']} GB, "
            f"step split generate {eng['engine_s']:.1f}s train {tr['train_s']:.1f}s "
            f"sync {eng['weight_sync_s']:.2f}s",
            flush=True,
        )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.grpo_steps:
        out_dir = Path(tempfile.mkdtemp(prefix="weir-gpu-step-"))
        report["grpo_local"] = grpo_run(
            "0.5b" if device.type == "cuda" else "tiny", args.grpo_steps, device, False, out_dir
        )
        print("grpo local:", report["grpo_local"], flush=True)
        if args.ray:
            try:
                import ray  # noqa: F401
            except ImportError:
                report["grpo_ray"] = "ray is not installed here"
            else:
                report["grpo_ray"] = grpo_run("0.5b", args.grpo_steps, device, True, out_dir)
            print("grpo ray:", report["grpo_ray"], flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
