"""GSM8K with a real model on one GPU: SmolLM2-135M-Instruct, GRPO on GSM8K's train set with the
`math` reward for a fixed wall-clock budget, test-set accuracy before and after.

Accuracy is reported three ways on the same greedy responses:

- ``strict``: verl's GSM8K scorer, strict method: the last ``#### <number>`` in the response's last
  300 characters, commas and ``$`` removed, equal as a string to the gold answer;
- ``flexible``: verl's flexible method: the last number-like token (``-?[0-9.,]+``, not ``""`` or
  ``"."``) in the last 300 characters, equal as a string to the gold (commas not removed);
- ``math``: weir's `math` reward (math-verify on the ``####`` line, else on the whole response), the
  reward the run trains on.

The prompt is verl's: the question, then "Let's think step by step and output the final answer after
"####"." in the model's chat template. Training stops after ``--train-seconds`` (a SIGINT to this
process: the run finishes its step and checkpoints) or ``--max-steps``, whichever comes first; the
newest checkpoint is exported and evaluated. The clock starts at the run's first reward (its own
step-0 evaluation of 8 problems, after the model is loaded). Prints a table and writes ``--out``
(JSON).

    python benchmarks/gsm8k_gpu.py --model DIR_OR_GGUF              # defaults: full test set, 240 s
    python benchmarks/gsm8k_gpu.py --model M --device cpu --test-size 4 --train-seconds 30 \\
        --batch-prompts 2 --n 2 --max-new-tokens 16                  # a CPU smoke run

scripts/gpu_gsm8k.sh packs what a bare GPU machine needs and runs this there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `gsm8k_gpu:scored` for the evaluator

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
CLIP = 300  # verl scores the last 300 characters of a response
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBERISH = re.compile(r"(\-?[0-9\.\,]+)")
RECORD: list[dict] = []


def verl_extract(text: str, method: str) -> str | None:
    """The answer verl's GSM8K scorer reads from `text` (see the module docstring), or None."""
    text = text[-CLIP:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    candidates = [c for c in _NUMBERISH.findall(text) if c not in ("", ".")]
    return candidates[-1] if candidates else None


def verl_score(text: str, gold: str, method: str) -> float:
    """1.0 when verl's `method` extraction of `text` equals `gold` as a string, else 0.0."""
    return float(verl_extract(text, method) == gold)


def scored(sample, row) -> dict:
    """The evaluation's reward: weir's `math`, with verl's strict and flexible scores recorded."""
    from weir.rollout.rewards import math as math_reward

    result = math_reward(sample, row)
    text = sample.response_text
    RECORD.append(
        {
            "math": float(result["reward"]),
            "strict": verl_score(text, row["answer"], "strict"),
            "flexible": verl_score(text, row["answer"], "flexible"),
            "tokens": float(len(sample.response_ids)),
            "truncated": float(sample.status.value == "truncated"),
        }
    )
    return result


def resolve_model(path: str, cache: Path) -> Path:
    """An HF directory for `path`: a GGUF file is converted once into `cache`."""
    from weir.train.gguf import gguf_model_dir, is_gguf

    if is_gguf(path):
        return gguf_model_dir(path, cache=cache, log=lambda m: print(f"[model] {m}", flush=True))
    return Path(path)


def base_config(args: argparse.Namespace, model: Path, run_dir: Path) -> dict:
    """What the evaluations and the training run share: model, device, data, prompt, reward."""
    return {
        "run": {"name": "gsm8k_gpu", "dir": str(run_dir), "seed": args.seed, "resume": "never"},
        "model": {"path": str(model), **({"threads": args.threads} if args.threads else {})},
        "data": {
            "task": "gsm8k",
            "task_options": {"instruction": INSTRUCTION},
            "max_prompt_tokens": 512,
        },
        "reward": {"function": "math"},
        "train": {"device": args.device},
        "engine": {"device": args.device},
        "telemetry": {"console": False, "trace": False},
    }


def evaluate_model(args: argparse.Namespace, model: Path, label: str) -> dict:
    """Greedy accuracy on `--test-size` test problems (a seeded subset; all when >= 1319)."""
    from weir import build_config
    from weir.loop.evaluation import run_eval

    cfg = base_config(args, model, args.workdir / f"eval_{label}")
    cfg["data"]["eval_size"] = args.test_size
    cfg["reward"] = {"function": "gsm8k_gpu:scored"}
    cfg["eval"] = {"temperature": 0.0, "n": 1, "max_new_tokens": args.max_new_tokens}
    cfg["run"]["steps"] = 0
    import gsm8k_gpu as me  # the module `gsm8k_gpu:scored` resolves to (this file runs as __main__)

    me.RECORD.clear()
    t0 = time.perf_counter()
    metrics = run_eval(build_config(cfg))
    record = me.RECORD
    if not record:
        raise RuntimeError("gsm8k_gpu: the evaluation scored no response")
    out = {k: statistics.fmean(r[k] for r in record) for k in record[0]}
    out |= {
        "problems": float(len(record)),
        "seconds": time.perf_counter() - t0,
        "weir_accuracy": metrics["eval/accuracy"],
    }
    print(f"[eval {label}] " + ", ".join(f"{k} {v:.4g}" for k, v in out.items()), flush=True)
    return out


def train(args: argparse.Namespace, model: Path) -> tuple[Path, dict]:
    """GRPO for `--train-seconds` (then a SIGINT: finish the step, checkpoint) or `--max-steps`;
    returns the trained model's directory and what the run did."""
    import weir
    from weir.train.export import export_model

    run_dir = args.workdir / "train"
    cfg = base_config(args, model, run_dir)
    cfg["run"] |= {"steps": args.max_steps, "eval_every": 0, "checkpoint_every": 0}
    cfg["data"]["eval_size"] = 8  # the run's own before/after evaluations: kept small
    cfg["rollout"] = {
        "n": args.n,
        "batch_prompts": args.batch_prompts,
        "temperature": 1.0,
        "max_new_tokens": args.max_new_tokens,
    }
    cfg["algo"] = {
        "advantage": "grpo",
        "policy_loss": "ppo",
        "loss_options": {"eps_low": 0.2, "eps_high": 0.28},
        "loss_agg": "token-mean",
    }
    cfg["train"] |= {"lr": args.lr, "grad_clip": 1.0, "micro_batch_tokens": args.micro_batch_tokens}
    from weir.rollout.rewards import math as math_reward

    timer = threading.Timer(args.train_seconds, os.kill, (os.getpid(), signal.SIGINT))
    started: list[float] = []

    def reward(sample, row):
        """`math`, starting the clock at the first call: the budget is the run's, not its start-up
        (model load, self-check), which a SIGINT would cut short before the first step."""
        if not started:
            started.append(time.perf_counter())
            timer.start()
        return math_reward(sample, row)

    try:
        result = weir.run(cfg, reward=reward)
    finally:
        timer.cancel()
    seconds = time.perf_counter() - (started[0] if started else time.perf_counter())
    steps = [h for h in result.history if "reward/mean" in h]
    trained = result.model_dir or export_model(run_dir, args.workdir / "trained")
    info = {
        "steps": float(len(steps)),
        "seconds": seconds,
        "stopped_by_time": float(result.stopped),
        "reward_first3": statistics.fmean(h["reward/mean"] for h in steps[:3]) if steps else 0.0,
        "reward_last3": statistics.fmean(h["reward/mean"] for h in steps[-3:]) if steps else 0.0,
        "response_len_first3": statistics.fmean(h["response/length_mean"] for h in steps[:3])
        if steps
        else 0.0,
        "response_len_last3": statistics.fmean(h["response/length_mean"] for h in steps[-3:])
        if steps
        else 0.0,
        "s_per_step": statistics.median(h["time/step"] for h in steps) if steps else 0.0,
    }
    print("[train] " + ", ".join(f"{k} {v:.4g}" for k, v in info.items()), flush=True)
    return Path(trained), info


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help="an HF directory or a GGUF file")
    ap.add_argument("--workdir", type=Path, default=Path("runs/gsm8k_gpu"))
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON results (default WORKDIR/result.json)"
    )
    ap.add_argument("--device", default="auto", help="auto (CUDA when present), cuda, cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU runs)")
    ap.add_argument("--test-size", type=int, default=1319, help="test problems (1319: all)")
    ap.add_argument("--train-seconds", type=float, default=240.0)
    ap.add_argument("--max-steps", type=int, default=10_000)
    ap.add_argument("--batch-prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--micro-batch-tokens", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = resolve_model(args.model, args.workdir / "cache")
    convert_s = time.perf_counter() - t0
    before = evaluate_model(args, model, "before")
    trained, run = train(args, model)
    after = evaluate_model(args, trained, "after")
    result = {
        "model": str(args.model),
        "convert_seconds": convert_s,
        "before": before,
        "train": run,
        "after": after,
        "settings": {k: str(v) for k, v in vars(args).items()},
    }
    out = args.out or args.workdir / "result.json"
    out.write_text(json.dumps(result, indent=2))
    print()
    print(
        f"GSM8K test ({int(before['problems'])} problems, greedy, {args.max_new_tokens} tokens), "
        f"{int(run['steps'])} GRPO steps in {run['seconds']:.0f} s ({run['s_per_step']:.1f} s/step)"
    )
    print("| accuracy | before | after |")
    print("| --- | --- | --- |")
    for key in ("strict", "flexible", "math"):
        print(f"| {key} | {before[key]:.3f} | {after[key]:.3f} |")
    print(f"| response tokens | {before['tokens']:.0f} | {after['tokens']:.0f} |")
    print(f"| truncated | {before['truncated']:.2f} | {after['truncated']:.2f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
