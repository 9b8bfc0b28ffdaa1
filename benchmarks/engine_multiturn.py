"""The torch engine under multi-turn traffic: what admissions copy, and what cross-turn KV reuse saves.

Workload: `--conversations` conversations, `--concurrency` at a time; each has up to `--turns` model
turns; a turn that ends with a stop token is continued by a request whose prompt is the conversation
so far + the completion + an observation of `--min-obs`..`--max-obs` tokens (as an agent loop does).
Every request is seeded, so all variants generate the same tokens. A random tiny model whose stop
tokens are ~1/8 of the vocabulary ends turns after a few tokens.

Variants, alternating, `--repeats` runs each (median [min-max]):

- ``before``: the cache placed at column 0 after a reallocation or move (``left_slack`` = 0, the
  placement before it was split evenly), no prefix cache;
- ``slack``: spare columns split between both edges, no prefix cache;
- ``slack+reuse``: and the prefix cache (``SamplingParams.keep_kv``).

    python benchmarks/engine_multiturn.py
    python benchmarks/engine_multiturn.py --size small --turns 6 --max-obs 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import weir.engine.slabs as slabs
from weir.engine import SamplingParams, TorchEngine
from weir.tasks.tiny_model import build_tiny_model

STOPS = list(range(6, 38))


def conversations(args, vocab: int) -> list[tuple[list[int], list[list[int]]]]:
    """Per conversation: its first prompt and one observation per later turn."""
    g = torch.Generator().manual_seed(1)

    def toks(lo: int, hi: int) -> list[int]:
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return torch.randint(40, vocab, (n,), generator=g).tolist()

    return [
        (toks(args.min_prompt, args.max_prompt), [toks(args.min_obs, args.max_obs)] * args.turns)
        for _ in range(args.conversations)
    ]


def run(engine: TorchEngine, convs, args, keep_kv: bool) -> dict[str, float]:
    lock, done = threading.Lock(), threading.Event()
    state = {"next": 0, "finished": 0, "tokens": 0}

    def start_next() -> None:
        with lock:
            i = state["next"]
            if i >= len(convs):
                return
            state["next"] += 1
        submit(i, 0, convs[i][0])

    def submit(i: int, turn: int, prompt: list[int]) -> None:
        params = SamplingParams(
            max_new_tokens=args.max_new,
            seed=1000 * i + turn,
            stop_token_ids=STOPS,
            keep_kv=keep_kv and turn + 1 < args.turns,  # the last turn is not continued
        )
        engine.submit(prompt, params).add_done_callback(
            lambda f: finished(i, turn, prompt, f.result()[0])
        )

    def finished(i: int, turn: int, prompt: list[int], c) -> None:
        with lock:
            state["tokens"] += len(c.token_ids)
        if c.finish_reason == "stop" and turn + 1 < args.turns:
            submit(i, turn + 1, prompt + c.token_ids + convs[i][1][turn])
            return
        with lock:
            state["finished"] += 1
            if state["finished"] == len(convs):
                done.set()
        start_next()

    t0 = time.perf_counter()
    for _ in range(args.concurrency):
        start_next()
    done.wait()
    seconds = time.perf_counter() - t0
    s = engine.stats()
    return {
        "seconds": seconds,
        "tokens": state["tokens"],
        "admitted": s["admitted"],
        "prefill": s["prefill_tokens"],
        "reused": s.get("prefix_reused_tokens", 0.0),
        "moves": s["kv_moves"],
        "reallocs": s["kv_reallocs"],
        "copied_mib": s["kv_copied_bytes"] / 2**20,
        "peak_mib": s["kv_peak_bytes"] / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="tiny", choices=["nano", "tiny", "small"])
    ap.add_argument("--conversations", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--min-obs", type=int, default=8)
    ap.add_argument("--max-obs", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(
            Path(tmp) / "m", size=args.size, seed=0, max_position_embeddings=1024
        )
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    convs = conversations(args, model.config.vocab_size)
    kw = dict(eos_token_ids=[1], pad_token_id=0, num_threads=args.threads)
    slack = slabs.left_slack
    variants = {"before": (False, False), "slack": (True, False), "slack+reuse": (True, True)}
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    warm = TorchEngine(model, **kw)
    run(warm, convs[:8], args, keep_kv=False)
    warm.close()
    for _ in range(args.repeats):
        for name, (use_slack, reuse) in variants.items():
            slabs.left_slack = slack if use_slack else (lambda cols_cap, need: 0)
            engine = TorchEngine(model, prefix_cache=reuse, **kw)
            try:
                results[name].append(run(engine, convs, args, keep_kv=reuse))
            finally:
                engine.close()
                slabs.left_slack = slack
    print(
        f"{args.size} model, {args.conversations} conversations x up to {args.turns} turns at "
        f"concurrency {args.concurrency}, prompts {args.min_prompt}-{args.max_prompt}, "
        f"observations {args.min_obs}-{args.max_obs}, <= {args.max_new} new tokens per turn; "
        f"{args.threads} thread(s); {args.repeats} alternating runs each, median [min-max]"
    )
    print(
        f"{'variant':<13}{'admitted':>9}{'prefill tok':>12}{'reused':>8}{'moves':>7}"
        f"{'reallocs':>9}{'copied MiB':>11}{'peak MiB':>9}{'seconds':>20}"
    )
    for name, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        secs = [r["seconds"] for r in rs]
        print(
            f"{name:<13}{med['admitted']:>9.0f}{med['prefill']:>12.0f}{med['reused']:>8.0f}"
            f"{med['moves']:>7.0f}{med['reallocs']:>9.0f}{med['copied_mib']:>11.1f}"
            f"{max(r['peak_mib'] for r in rs):>9.1f}"
            f"{med['seconds']:>9.2f} [{min(secs):.2f}-{max(secs):.2f}]"
        )
        assert len({r["tokens"] for r in rs}) == 1, "seeded runs generated different tokens"
    tokens = {rs[0]["tokens"] for rs in results.values()}
    print(f"same tokens generated by every variant: {len(tokens) == 1}")


if __name__ == "__main__":
    main()
