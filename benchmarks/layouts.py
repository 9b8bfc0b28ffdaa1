"""The trainer step in each exact layout, alternating in one process, beside the cost model's
prediction (`weir.train.layout_cost`): does `auto` pick the layout that is fastest here?

Batches: GRPO groups on weir's tiny model (or --model), prompts and responses drawn from a mix:

    equal:  P = 32, R = 32 for every sample
    spread: P = 32, R lognormal (median about 40, 4-256)
    long:   P U[8, 64], R lognormal (median about 120, 4-512)

Each step trains one update (fused old log-probs, dead rows skipped) in every layout in turn
(`varlen`, `prefix`, `padded`; the first layout rotates each step); the figures are medians over
--reps steps, with the predicted cost relative to the cheapest. On a CPU `varlen` runs SDPA per
sequence and `prefix` splits responses into passes by length; on CUDA `varlen` is torch's
FlashAttention-2 and `prefix` runs one pass (the cost model prices each as it runs).

    python benchmarks/layouts.py --reps 5                 # a CPU (or --device cuda)
    python benchmarks/layouts.py --model tiny:small --prompts 32 --budget 32768   # on a GPU

The first step of each layout is a warm-up on a GPU (lazy CUDA modules, allocator growth): give
--reps 4 or more there and read the median.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time

import torch

from weir.config import build_config
from weir.data.sample import Group, Sample
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.layout_cost import cheapest_layout
from weir.train.model import load_model, resolve_model_path

LAYOUTS = ["varlen", "prefix", "padded"]


def _lognormal(rnd: random.Random, median: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rnd.lognormvariate(math.log(median), 0.8))))


MIXES = {
    "equal": (lambda r: 32, lambda r: 32),
    "spread": (lambda r: 32, lambda r: _lognormal(r, 40, 4, 256)),
    "long": (lambda r: r.randint(8, 64), lambda r: _lognormal(r, 120, 4, 512)),
}


def batch_of(mix: str, prompts: int, n: int, vocab: int, seed: int):
    prompt_len, response_len = MIXES[mix]
    rnd = random.Random(seed)
    groups = []
    for g in range(prompts):
        prompt = [rnd.randrange(6, vocab) for _ in range(prompt_len(rnd))]
        samples = []
        for i in range(n):
            resp = [rnd.randrange(6, vocab) for _ in range(response_len(rnd))]
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=resp,
                    rollout_logprobs=[-3.0] * len(resp),
                    versions=[0] * len(resp),
                    reward=float(i % 2),
                    group_id=g,
                    index=i,
                )
            )
        groups.append(Group(samples=samples, group_id=g))
    return make_batch(groups, version=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:tiny")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model, tempfile.mkdtemp())
    actors = {}
    for layout in LAYOUTS:
        model, _ = load_model(path, device=args.device)
        cfg = build_config(
            {}, [f"train.packing={layout}", f"train.micro_batch_tokens={args.budget}"]
        )
        actors[layout] = Actor(model, ActorSettings.from_config(cfg))
    chooser = actors["varlen"]._layout_choice(LAYOUTS)
    vocab = int(actors["varlen"].model.config.vocab_size)
    print(
        f"model {args.model} on {args.device}, {args.prompts} prompts x {args.n}, "
        f"budget {args.budget}"
    )
    for mix in args.mixes.split(","):
        times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
        for rep in range(args.reps):
            batch = batch_of(mix, args.prompts, args.n, vocab, seed=rep)
            order = LAYOUTS[rep % 3 :] + LAYOUTS[: rep % 3]
            for name in order:
                start = time.perf_counter()
                actors[name].train(batch)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - start)
        picked, relative = cheapest_layout(
            LAYOUTS,
            batch.sequences,
            batch.response_lengths,
            args.budget,
            chooser.prices,
            one_pass=chooser.one_pass,
        )
        fastest = min(LAYOUTS, key=lambda k: statistics.median(times[k]))
        best = statistics.median(times[fastest])
        cells = ", ".join(
            f"{k} {statistics.median(times[k]):.3f}s ({min(times[k]):.3f}-{max(times[k]):.3f}; "
            f"{statistics.median(times[k]) / best:.2f}x measured, {relative[k]:.2f}x modelled)"
            for k in LAYOUTS
        )
        print(f"{mix}: {cells}; auto picks {picked}, fastest {fastest}")


if __name__ == "__main__":
    main()
