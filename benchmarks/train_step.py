"""The trainer step alone, before and after issue 17, alternating in one process (one torch thread).

before: padded rows, old log-probs from a separate no-grad pass, backward through every row (the
        step as it was with `train.packing=auto` on a CPU).
forward: `train.packing=auto` with `train.dead_rows=forward`: the prefix layout (each distinct
        prompt runs once), old log-probs from the update's own forward, no backward for rows of
        zero advantage (their forward runs, for metrics over every row).
skip:   the default now: as `forward`, and no forward either for rows of zero advantage.

Batches are shaped like vs_trl.py's workloads on weir's tiny model (8-token prompts): A = 32
prompts x 8 answers of 2-4 tokens, B = 8 prompts x 8 answers of 128 tokens; each sample is right
with probability --p-correct (0.1 is about what the SFT'd model of vs_trl.py starts at), so some
groups have equal rewards and zero advantage, as in a real run. GRPO, PPO clip 0.2/0.28,
token-mean, old log-probs recomputed, one update per step.

    python benchmarks/train_step.py --reps 5
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch

from weir.config import build_config
from weir.data.sample import Group, Sample
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.model import load_model

SHAPES = {"A": (32, 8, (2, 4)), "B": (8, 8, (128, 128))}


def batch_of(workload: str, p_correct: float, seed: int):
    prompts, n, (lo, hi) = SHAPES[workload]
    rnd = random.Random(seed)
    groups = []
    for g in range(prompts):
        prompt = [rnd.randrange(6, 200) for _ in range(8)]
        samples = []
        for i in range(n):
            resp = [rnd.randrange(6, 200) for _ in range(rnd.randint(lo, hi))]
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=resp,
                    rollout_logprobs=[-3.0] * len(resp),
                    versions=[0] * len(resp),
                    reward=float(rnd.random() < p_correct),
                    group_id=g,
                    index=i,
                )
            )
        groups.append(Group(samples=samples, group_id=g))
    return make_batch(groups, version=0)


VARIANTS = ("before", "forward", "skip")


def actor(model_dir: str, variant: str) -> Actor:
    model, _ = load_model(model_dir)
    after = variant != "before"
    cfg = build_config(
        {},
        [
            f"train.packing={'auto' if after else 'padded'}",
            f"train.dead_rows={'skip' if variant == 'skip' else 'forward'}",
            "train.lr=5e-5",
            "rollout.max_new_tokens=128",
        ],
    )
    a = Actor(model, ActorSettings.from_config(cfg))
    a.fuses_old_logprobs = a.skips_dead_backward = after
    return a


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--p-correct", type=float, default=0.1)
    ap.add_argument("--model", default=None, help="HF model dir (default: weir's tiny model)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from weir.tasks.tiny_model import build_tiny_model

            model_dir = str(build_tiny_model(f"{tmp}/tiny", size="tiny"))
        print(f"load average {os.getloadavg()[0]:.1f}; {args.reps} steps each, alternating")
        for wl in SHAPES:
            batches = [batch_of(wl, args.p_correct, seed) for seed in range(args.reps + 1)]
            actors = {v: actor(model_dir, v) for v in VARIANTS}
            times: dict[str, list[float]] = {k: [] for k in actors}
            dead = []
            for rep, batch in enumerate(batches):
                k = rep % len(VARIANTS)
                for name in VARIANTS[k:] + VARIANTS[:k]:  # each variant goes first in turn
                    t = time.perf_counter()
                    stats = actors[name].train(batch)
                    if rep:  # the first step warms up
                        times[name].append(time.perf_counter() - t)
                    if name == "skip":
                        dead.append(stats["train/dead_rows"])
            line = [f"{wl} (dead rows {statistics.mean(dead):.0%})"]
            for name in VARIANTS:
                t = times[name]
                line.append(f"{name} {statistics.median(t):.3f} s/step ({min(t):.3f}-{max(t):.3f})")
            for name in VARIANTS[1:]:
                ratios = [x / y for x, y in zip(times["before"], times[name], strict=True)]
                line.append(
                    f"before/{name} {statistics.median(ratios):.2f}x "
                    f"({min(ratios):.2f}-{max(ratios):.2f})"
                )
            ratios = [x / y for x, y in zip(times["forward"], times["skip"], strict=True)]
            line.append(
                f"forward/skip {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            )
            print("; ".join(line) + f"; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
