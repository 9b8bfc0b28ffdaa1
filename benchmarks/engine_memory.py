"""KV-cache memory of the TorchEngine: slab reallocations and throughput before/after geometric growth,
and what a KV budget costs.

Workload: a stream of requests at a fixed concurrency (a finished request's callback submits the next),
prompt lengths and ``max_new_tokens`` drawn per request, as in RL rollouts or a server: requests join
a running batch all the time, which is where the slab policy matters. Sampling is seeded per request,
so every variant generates the same tokens.

Variants, run alternately ``--repeats`` times each (median and range reported, ratios to the first):

- ``before``: the engine as of git revision ``--baseline-rev`` (columns sized exactly on each
  reallocation), loaded from ``git show`` into a scratch module; skipped outside a git checkout;
- ``after``: this checkout (capacity doubles when it runs out, in-place moves otherwise);
- ``budget``: this checkout with ``kv_budget_gb`` at ``--budget-fraction`` of ``after``'s peak.

    python benchmarks/engine_memory.py                        # tiny model, 192 requests, 24 at once
    python benchmarks/engine_memory.py --size small --requests 256 --concurrency 48
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from weir.engine import SamplingParams, TorchEngine
from weir.tasks.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def load_baseline(rev: str):
    """The `torch_engine` module as of git revision `rev`, or None when git cannot give it."""
    try:
        src = subprocess.run(
            ["git", "show", f"{rev}:weir/engine/torch_engine.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "weir_engine_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("weir_engine_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    counter = {"reallocs": 0}
    realloc = module._Running._realloc_cache

    def counted(self, *a, **k):
        counter["reallocs"] += 1
        return realloc(self, *a, **k)

    module._Running._realloc_cache = counted
    module.REALLOCS = counter
    return module


def workload(count: int, vocab: int, args, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(args.min_prompt, args.max_prompt + 1, (count,), generator=g).tolist()
    news = torch.randint(args.min_new, args.max_new + 1, (count,), generator=g).tolist()
    prompts = [torch.randint(6, vocab, (n,), generator=g).tolist() for n in lens]
    params = [
        SamplingParams(n=args.n, max_new_tokens=m, temperature=1.0, seed=i)
        for i, m in enumerate(news)
    ]
    return prompts, params


def stream(engine, prompts, params, concurrency: int) -> tuple[int, float]:
    """Keep `concurrency` requests in flight until all are done; (tokens generated, seconds)."""
    lock, done = threading.Lock(), threading.Event()
    state = {"next": 0, "finished": 0, "tokens": 0}

    def submit_next() -> None:
        with lock:
            i = state["next"]
            if i >= len(prompts):
                return
            state["next"] += 1
        engine.submit(prompts[i], params[i]).add_done_callback(on_done)

    def on_done(fut) -> None:
        tokens = sum(len(c.token_ids) for c in fut.result())
        with lock:
            state["tokens"] += tokens
            state["finished"] += 1
            if state["finished"] == len(prompts):
                done.set()
        submit_next()

    t0 = time.perf_counter()
    for _ in range(concurrency):
        submit_next()
    done.wait()
    return state["tokens"], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="tiny", choices=["nano", "tiny", "small"])
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--min-new", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--budget-fraction", type=float, default=0.5)
    ap.add_argument("--baseline-rev", default="af8c57d")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(
            Path(tmp) / "m", size=args.size, seed=0, max_position_embeddings=512
        )
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts, params = workload(args.requests, model.config.vocab_size, args, seed=1)
    kw = dict(eos_token_ids=[1], pad_token_id=0, num_threads=args.threads or None)
    baseline = load_baseline(args.baseline_rev)

    def run(variant: str, budget_gb: float | None) -> dict[str, float]:
        if variant == "before":
            baseline.REALLOCS["reallocs"] = 0
            engine = baseline.TorchEngine(model, **kw)
        else:
            engine = TorchEngine(model, kv_budget_gb=budget_gb, **kw)
        tokens, seconds = stream(engine, prompts, params, args.concurrency)
        if variant == "before":
            out = {"reallocs": baseline.REALLOCS["reallocs"], "moves": float("nan")}
            out["peak_mb"] = float("nan")
        else:
            s = engine.kv_stats()
            out = {"reallocs": s["kv_reallocs"], "moves": s["kv_moves"]}
            out["peak_mb"] = s["kv_peak_bytes"] / 2**20
        engine.close()
        out.update(tokens=tokens, tok_s=tokens / seconds)
        return out

    stream_warm = TorchEngine(model, **kw)  # warm-up (allocator, kernels)
    stream(stream_warm, prompts[:32], params[:32], args.concurrency)
    stream_warm.close()
    after_peak = run("after", None)["peak_mb"]
    budget_gb = args.budget_fraction * after_peak / 1024
    variants = (["before"] if baseline is not None else []) + ["after", "budget"]
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            results[v].append(run(v, budget_gb if v == "budget" else None))

    ref = "before" if baseline is not None else "after"
    ref_tok = statistics.median(r["tok_s"] for r in results[ref])
    print(
        f"{args.size} model, {args.requests} requests x n={args.n} at concurrency "
        f"{args.concurrency}, prompts {args.min_prompt}-{args.max_prompt}, new tokens "
        f"{args.min_new}-{args.max_new}; {args.repeats} alternating runs each, median [min-max]"
    )
    if baseline is None:
        print(f"(no 'before': git show {args.baseline_rev} failed)")
    print(f"budget variant: kv_budget_gb = {budget_gb * 1024:.1f} MiB")
    print(f"{'variant':<8}{'reallocs':>10}{'moves':>8}{'peak MiB':>10}{'tokens/s':>22}{'ratio':>8}")
    for v in variants:
        rs = results[v]
        tok = [r["tok_s"] for r in rs]
        med = statistics.median(tok)
        print(
            f"{v:<8}{statistics.median(r['reallocs'] for r in rs):>10.0f}"
            f"{statistics.median(r['moves'] for r in rs):>8.0f}"
            f"{max(r['peak_mb'] for r in rs):>10.1f}"
            f"{med:>10.0f} [{min(tok):.0f}-{max(tok):.0f}]"
            f"{med / ref_tok:>8.2f}"
        )
        assert len({r["tokens"] for r in rs}) == 1, "seeded runs generated different token counts"


if __name__ == "__main__":
    main()
