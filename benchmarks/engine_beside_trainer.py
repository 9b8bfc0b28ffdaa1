"""Does generation slow down beside a training trainer, and is it Python's GIL?

`loop.mode=async` runs the trainer in the main thread and the built-in engine in a thread of the
same process, one torch thread each. This times one workload-B generation (8 prompts x n 8, 128
new tokens, no stop token; the tiny model, one thread) three ways, alternating within each repeat:
alone, beside a trainer looping over B-shaped steps in a thread of this process (as async runs
it), and beside the same trainer in a process of its own (no GIL shared). It also reports the
trainer's step time alone and in each arrangement. If the thread and the process arrangements slow
generation alike, the cost is the cores' shared caches and memory bandwidth, not the GIL.

    python benchmarks/engine_beside_trainer.py --repeats 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from train_step import actor, batch_of  # noqa: E402

from weir.engine import SamplingParams, TorchEngine  # noqa: E402
from weir.tasks.tiny_model import build_tiny_model  # noqa: E402


def generate(engine: TorchEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    t = time.perf_counter()
    for f in engine.submit_many(prompts, params):
        f.result()
    return time.perf_counter() - t


def train_loop(model_dir: str, stop, times) -> None:
    """Train B-shaped steps until `stop` is set, appending each step's seconds to `times`."""
    torch.set_num_threads(1)
    trainer = actor(model_dir, "skip")
    batches = [batch_of("B", 0.1, seed) for seed in range(4)]
    i = 0
    while not stop.is_set():
        t = time.perf_counter()
        trainer.train(batches[i % len(batches)])
        times.append(time.perf_counter() - t)
        i += 1


def beside(kind: str, model_dir: str, gen, warm_s: float) -> tuple[list[float], list[float]]:
    """Generation times (3) with a trainer running as a `thread` or a `process`, and its steps."""
    if kind == "thread":
        stop, times = threading.Event(), []
        worker = threading.Thread(target=train_loop, args=(model_dir, stop, times))
    else:
        ctx = mp.get_context("spawn")
        manager = ctx.Manager()
        stop, times = ctx.Event(), manager.list()
        worker = ctx.Process(target=train_loop, args=(model_dir, stop, times))
    worker.start()
    while len(times) < 1:  # the trainer is built and has taken a step
        time.sleep(0.05)
    time.sleep(warm_s)
    first = len(times)
    gens = [gen() for _ in range(3)]
    steps = list(times)[first:]
    stop.set()
    worker.join()
    if kind == "process":
        manager.shutdown()
    return gens, steps


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = tempfile.mkdtemp()
    build_tiny_model(model_dir, "tiny")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 262, (8,), generator=g).tolist() for _ in range(8)]
    params = SamplingParams(n=8, max_new_tokens=128, seed=1)
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=0, num_threads=1)
    gen = lambda: generate(engine, prompts, params)  # noqa: E731
    gen()
    trainer = actor(model_dir, "skip")
    batches = [batch_of("B", 0.1, seed) for seed in range(4)]
    trainer.train(batches[0])

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})" if xs else "-"

    print(f"{os.cpu_count()} cores; generation of 64 x 128 tokens, s; trainer step (B), s")
    for rep in range(args.repeats):
        alone = [gen() for _ in range(3)]
        steps_alone = []
        for b in batches[1:]:
            t = time.perf_counter()
            trainer.train(b)
            steps_alone.append(time.perf_counter() - t)
        by_thread, steps_thread = beside("thread", model_dir, gen, 0.5)
        by_process, steps_process = beside("process", model_dir, gen, 0.5)
        print(
            f"repeat {rep} (load {os.getloadavg()[0]:.1f}): generation alone {fmt(alone)}, beside "
            f"a trainer thread {fmt(by_thread)}, beside a trainer process {fmt(by_process)}; "
            f"trainer step alone {fmt(steps_alone)}, as a thread {fmt(steps_thread)}, as a "
            f"process {fmt(steps_process)}",
            flush=True,
        )
    engine.close()


if __name__ == "__main__":
    main()
