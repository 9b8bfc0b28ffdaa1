"""Where a TorchEngine decode step goes, on workload B's shape: 64 rows x 128 new tokens, one thread.

The engine is driven from this thread (its own loop paused), so every phase of a decode step can be
timed with the clock: the model forward, sampling (`weir.engine.sampler` and recording the token),
and the rest of the step (masks, positions, stop checks, retirement: bookkeeping). Prefill and
admission are timed apart. The forward is then split by a `torch.profiler` pass into attention
(SDPA / eager kernels), matmuls (projections, MLP, lm_head), the other aten ops, and what no op
accounts for (Python and module dispatch), each as a share of the profiled forward. Finally the
whole generation is run through the engine's own thread twice: from plain futures and through
asyncio (``engine.generate`` per prompt, gathered), to show what the event loop adds.

Both forward paths are measured, alternating within each repeat: the HF model's forward
(``direct_decode=False``) and `weir.engine.decode.DecodeForward` (the default); the tokens and
log-probs of the two are checked to be identical. Times are per decode step, median over repeats,
with the range; the load average is printed (the machine may be shared).

    python benchmarks/engine_decode.py                     # tiny (qwen3), 8 prompts x n=8, 128 tokens
    python benchmarks/engine_decode.py --size small --arch llama --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AutoModelForCausalLM

from weir.engine import SamplingParams, TorchEngine
from weir.tasks.tiny_model import build_tiny_model


class Timed:
    """Wrap `engine.<name>` so that its wall time adds up in `totals[name]`."""

    def __init__(self, engine: TorchEngine, totals: dict[str, float], *names: str):
        for name in names:
            fn = getattr(engine, name)

            def wrapped(*a, _fn=fn, _name=name, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    totals[_name] += time.perf_counter() - t0

            setattr(engine, name, wrapped)


def drive(engine: TorchEngine, prompts, params) -> tuple[list, int]:
    """Generate in this thread (the engine's loop is paused); returns completions and steps."""
    futures = engine.submit_many(prompts, params)
    steps0 = engine.stats()["decode_steps"]
    with engine._step_lock, torch.inference_mode():
        while not all(f.done() for f in futures):
            engine._iteration()
    return [f.result() for f in futures], int(engine.stats()["decode_steps"] - steps0)


def phases(engine: TorchEngine, prompts, params) -> tuple[dict[str, float], list]:
    totals: dict[str, float] = defaultdict(float)
    Timed(engine, totals, "_decode_step", "_decode_forward", "_sample_and_record", "_admit")
    t0 = time.perf_counter()
    out, steps = drive(engine, prompts, params)
    total = time.perf_counter() - t0
    for name in ("_decode_step", "_decode_forward", "_sample_and_record", "_admit"):
        del engine.__dict__[name]
    # _sample_and_record also runs once in admission (the first token): attribute per step only
    # what ran inside decode steps.
    step, fwd = totals["_decode_step"], totals["_decode_forward"]
    sample_in_steps = totals["_sample_and_record"] * steps / (steps + 1)
    ms = 1000.0 / steps
    return {
        "step": step * ms,
        "forward": fwd * ms,
        "sampling": sample_in_steps * ms,
        "bookkeeping": (step - fwd - sample_in_steps) * ms,
        "admission (once)": totals["_admit"] * 1000.0,
        "generation (s)": total,
    }, out


CATEGORIES = (
    ("attention", ("scaled_dot_product", "_softmax", "bmm")),
    ("matmuls", ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear")),
)


def forward_split(engine: TorchEngine, prompts, params) -> dict[str, float]:
    """Seconds of the decode forwards under the profiler: each op category's self time inside
    them, and the forwards' wall time (``_forward_s``)."""
    fn = engine._decode_forward
    wall = [0.0]

    def marked(*a, **k):
        t0 = time.perf_counter()
        with record_function("weir_decode_forward"):
            out = fn(*a, **k)
        wall[0] += time.perf_counter() - t0
        return out

    engine._decode_forward = marked
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        drive(engine, prompts, params)
    del engine.__dict__["_decode_forward"]
    split: dict[str, float] = defaultdict(float)

    def add(ev) -> None:
        cat = next((c for c, keys in CATEGORIES if any(k in ev.name for k in keys)), "other ops")
        split[cat] += ev.self_cpu_time_total / 1e6
        for child in ev.cpu_children:
            add(child)

    for ev in prof.events():
        if ev.name == "weir_decode_forward":
            for child in ev.cpu_children:
                add(child)
    return dict(split) | {"_ops_s": sum(split.values()), "_forward_s": wall[0]}


async def via_asyncio(engine: TorchEngine, prompts, params) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return time.perf_counter() - t0


def via_futures(engine: TorchEngine, prompts, params) -> float:
    t0 = time.perf_counter()
    for f in engine.submit_many(prompts, params):
        f.result()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp()
    build_tiny_model(tmp, args.size, arch=args.arch)
    model = AutoModelForCausalLM.from_pretrained(tmp).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(6, 262, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)
    ]
    # No stop token: every row decodes max_new_tokens (workload B).
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=1)
    paths = {"HF forward": False, "direct": True}
    engines = {
        name: TorchEngine(
            model, eos_token_ids=[], pad_token_id=0, num_threads=args.threads, direct_decode=d
        )
        for name, d in paths.items()
    }
    for e in engines.values():
        via_futures(e, prompts, params)  # warm-up through the engine's own thread
        e.pause_sync()
    loads = [os.getloadavg()[0]]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    outs = {}
    for _ in range(args.repeats):
        for name, e in engines.items():
            r, outs[name] = phases(e, prompts, params)
            results[name].append(r)
        loads.append(os.getloadavg()[0])
    same = all(
        a.token_ids == b.token_ids and a.logprobs == b.logprobs
        for ra, rb in zip(outs["HF forward"], outs["direct"], strict=True)
        for a, b in zip(ra, rb, strict=True)
    )
    splits = {name: forward_split(e, prompts, params) for name, e in engines.items()}
    e2e: dict[str, dict[str, list[float]]] = {n: defaultdict(list) for n in engines}
    for e in engines.values():
        e.resume_sync()
    for _ in range(args.repeats):
        for name, e in engines.items():
            e2e[name]["futures"].append(via_futures(e, prompts, params))
            e2e[name]["asyncio"].append(asyncio.run(via_asyncio(e, prompts, params)))
        loads.append(os.getloadavg()[0])
    for e in engines.values():
        e.close()

    rows = args.prompts * args.n
    print(
        f"{args.size} {args.arch} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), "
        f"{rows} rows x {args.max_new_tokens} new tokens, prompts of {args.prompt_len}, "
        f"{args.threads} torch thread(s); {args.repeats} alternating repeats; {os.cpu_count()} "
        f"cores, load average {min(loads):.1f}-{max(loads):.1f}; direct = HF tokens and "
        f"log-probs: {same}"
    )
    keys = ["step", "forward", "sampling", "bookkeeping", "admission (once)"]
    print(f"{'ms per decode step':<22}" + "".join(f"{n:>26}" for n in engines))
    for k in keys:
        cells = []
        for name in engines:
            vals = [r[k] for r in results[name]]
            cells.append(
                f"{statistics.median(vals):8.2f} ({min(vals):.2f}-{max(vals):.2f})".rjust(26)
            )
        print(f"{k:<22}" + "".join(cells))
    print(f"{'forward, profiled':<22}" + "".join(" " * 26 for _ in engines))
    for cat in ("attention", "matmuls", "other ops"):
        print(
            f"  {cat:<20}"
            + "".join(
                f"{100 * splits[n].get(cat, 0.0) / splits[n]['_forward_s']:7.0f} %".rjust(26)
                for n in engines
            )
        )
    print(
        f"  {'no op (Python)':<20}"
        + "".join(
            f"{100 * (1 - splits[n]['_ops_s'] / splits[n]['_forward_s']):7.0f} %".rjust(26)
            for n in engines
        )
    )
    for how in ("futures", "asyncio"):
        print(
            f"{'end to end, ' + how + ' (s)':<22}"
            + "".join(
                f"{statistics.median(e2e[n][how]):8.3f} ({min(e2e[n][how]):.3f}-{max(e2e[n][how]):.3f})".rjust(
                    26
                )
                for n in engines
            )
        )


if __name__ == "__main__":
    main()
