"""LoRA against full fine-tuning: memory and time of one trainer step on the same batch.

Each run is a fresh process (so peak memory is that run's own), and runs alternate full, lora,
full, lora, ... so that a machine whose load drifts affects both modes alike. Per run:

- trainable parameters, and the bytes of optimizer state (AdamW: two moments per trainable
  parameter) and of gradients after a step;
- peak resident memory of the training phase (CPU: VmHWM, reset after the model is built) or
  peak allocated CUDA memory; and the same for the whole process (model build included);
- step time: the median over `--steps` timed `Actor.train` calls after one warm-up call.

The model is a random-init Qwen3 of the chosen shape (no download); the batch is `--prompts` x
`--n` samples of random tokens (`--prompt-len` + `--response-len`) with random rewards, trained
with GRPO + PPO clipping as in a run.

    python benchmarks/lora_vs_full.py                          # 40M shape on the CPU, 3 runs each
    python benchmarks/lora_vs_full.py --shape 0.5b --device cuda --runs 3
    python benchmarks/lora_vs_full.py --kl 0.01                # with a KL reference (full: a copy)

Prints a table (median and range over the runs) and writes every figure to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from model_shapes import QWEN25, SMALL  # benchmarks/model_shapes.py (the script's folder)

SHAPES: dict[str, dict[str, Any]] = {
    **SMALL,
    "0.5b": {k: v for k, v in QWEN25["0.5b"].items() if k != "tie_word_embeddings"},  # in Qwen3
}
MB = 2**20


def _hwm_reset() -> bool:
    """Reset the process's peak-RSS mark (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _batch(args, vocab: int):
    import torch

    from weir.data.sample import Group, Sample
    from weir.train.batch import make_batch

    g = torch.Generator().manual_seed(0)
    groups = []
    for gid in range(args.prompts):
        prompt = torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist()
        samples = [
            Sample(
                prompt_ids=prompt,
                response_ids=torch.randint(10, vocab, (args.response_len,), generator=g).tolist(),
                versions=[0] * args.response_len,
                reward=float(torch.rand((), generator=g) < 0.5),
                group_id=gid,
                index=i,
            )
            for i in range(args.n)
        ]
        groups.append(Group(samples=samples, group_id=gid))
    return make_batch(groups, version=0)


def child(args) -> dict[str, Any]:
    """One run of one mode, in this process; returns its figures."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from weir.config import build_config
    from weir.train.actor import Actor, ActorSettings
    from weir.train.lora import LoraActor, apply_lora, require_peft

    require_peft()  # both modes import the same modules before memory is measured

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    shape = dict(SHAPES[args.shape])
    config = Qwen3Config(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"])
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    total_params = sum(p.numel() for p in model.parameters())
    lora = args.mode == "lora"
    overrides = [
        f"rollout.batch_prompts={args.prompts}",
        f"rollout.n={args.n}",
        f"train.lr={args.lr_lora if lora else args.lr_full}",
        "train.compute_dtype=" + ("bfloat16" if device.type == "cuda" else "float32"),
        f"train.gradient_checkpointing={str(args.checkpointing).lower()}",
        f"train.micro_batch_tokens={args.micro_batch_tokens}",
        "algo.old_logprobs=engine",
        f"algo.kl.coef={args.kl}",
        f"lora.enabled={str(lora).lower()}",
        f"lora.rank={args.rank}",
        f"lora.alpha={2 * args.rank}",
    ]
    cfg = build_config({}, overrides)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        _hwm_reset()
        before = _hwm_bytes()
    if lora:
        model = apply_lora(model, cfg.lora, seed=0)
        actor: Actor = LoraActor(model, ActorSettings.from_config(cfg))
    else:
        actor = Actor(model, ActorSettings.from_config(cfg))
    batch = _batch(args, shape["vocab_size"])
    batch.rollout_logprobs = actor.logprobs(actor.model, batch)
    times = []
    for i in range(args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        actor.train(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first call is the warm-up (allocates optimizer state)
            times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _hwm_bytes() - before
    opt_bytes = sum(
        t.numel() * t.element_size()
        for state in actor.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    grad_bytes = sum(
        p.grad.numel() * p.grad.element_size()
        for p in actor.model.parameters()
        if p.grad is not None
    )
    return {
        "mode": args.mode,
        "total_params": total_params,
        "trainable_params": sum(p.numel() for p in actor.model.parameters() if p.requires_grad),
        "optimizer_state_mb": opt_bytes / MB,
        "grad_mb": grad_bytes / MB,
        "train_peak_mb": peak / MB,
        "process_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": statistics.median(times),
        "step_times": times,
        "tokens_per_step": sum(len(s) for s in batch.sequences),
    }


FIELDS = (
    ("trainable_params", "trainable params", "{:,.0f}"),
    ("optimizer_state_mb", "optimizer state MB", "{:.1f}"),
    ("grad_mb", "gradients MB", "{:.1f}"),
    ("train_peak_mb", "train-phase peak MB", "{:.0f}"),
    ("process_peak_rss_mb", "process peak RSS MB", "{:.0f}"),
    ("step_s", "step s (median)", "{:.3f}"),
)


def _summary(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if min(values) == max(values):
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="40m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3, help="runs per mode (alternating)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after a warm-up)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kl", type=float, default=0.0, help="algo.kl.coef (> 0: a KL reference)")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    ap.add_argument("--lr-full", type=float, default=1e-5)
    ap.add_argument("--lr-lora", type=float, default=1e-3)
    ap.add_argument("--out", default="lora_vs_full.json")
    ap.add_argument("--child", choices=("full", "lora"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.mode = args.child
        print(json.dumps(child(args)))
        return
    argv = [a for a in sys.argv[1:]]
    results: dict[str, list[dict[str, Any]]] = {"full": [], "lora": []}
    for run in range(args.runs):
        for mode in ("full", "lora"):
            out = subprocess.run(
                [sys.executable, __file__, *argv, "--child", mode],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                sys.exit(f"{mode} run {run} failed:\n{out.stderr[-3000:]}")
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = results[mode][-1]
            print(
                f"run {run} {mode}: step {r['step_s']:.3f} s, train peak {r['train_peak_mb']:.0f} MB"
            )
    first = results["full"][0]
    print(
        f"\n{args.shape} ({first['total_params'] / 1e6:.1f}M parameters) on {args.device}, "
        f"{first['tokens_per_step']} tokens per step, LoRA rank {args.rank} on all linear layers, "
        f"{args.runs} alternating runs per mode, {args.steps} timed steps each "
        f"({platform.node()}, {args.threads} threads)"
    )
    print(f"{'':24}{'full':>28}{'lora':>28}")
    for key, label, fmt in FIELDS:
        cells = [_summary([r[key] for r in results[m]], fmt) for m in ("full", "lora")]
        print(f"{label:24}{cells[0]:>28}{cells[1]:>28}")
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
