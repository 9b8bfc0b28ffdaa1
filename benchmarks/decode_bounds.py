"""What bounds a decode step of workload B on this CPU, piece by piece, and what a second core buys.

Part 1 times, alone and with the clock (the profiler inflates ops this small), the pieces of one
layer's decode step at B's shape (64 rows, the tiny Qwen3: 2 KV heads of 32, 4 query heads, ~150
columns of context in slabs of 256): SDPA as the engine calls it and three variants, the attention
written out, its first product alone, an MLP projection, and the core's read rate from a 5 MB
tensor (as big as one layer's keys and values) for comparison.

Part 2 generates B's batch (8 prompts x n 8, 128 tokens, no stop token) with the engine in a child
process (`engine.process`): one engine with all 64 rows, against two engines of 32 rows each
running at once (one core each), alternating.

    python benchmarks/decode_bounds.py
    python benchmarks/decode_bounds.py --repeats 6 --skip-engines
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F


def per_call_us(fn, calls: int) -> float:
    for _ in range(max(5, calls // 20)):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def pieces(calls: int) -> list[tuple[str, float]]:
    rows, kv_heads, ctx, dim, cap = 64, 2, 150, 32, 256
    g = torch.Generator().manual_seed(0)
    k = torch.randn(rows, kv_heads, cap, dim, generator=g)[:, :, :ctx]
    v = torch.randn(rows, kv_heads, cap, dim, generator=g)[:, :, :ctx]
    q = torch.randn(rows, kv_heads, 2, dim, generator=g)  # the 2 query heads of a group as 2 rows
    q4 = q.reshape(rows, 2 * kv_heads, 1, dim)
    mask = torch.ones(rows, 1, 1, ctx, dtype=torch.bool)
    mask[: rows // 8, ..., : ctx // 8] = False  # some rows' left padding
    kc, vc = k.contiguous(), v.contiguous()
    scale = dim**-0.5
    h = torch.randn(rows, 128, generator=g)
    w = torch.randn(384, 128, generator=g)
    big = torch.randn(5 * 2**18, generator=g)  # 5 MB

    def written_out() -> torch.Tensor:
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        return torch.matmul(s.masked_fill(~mask, float("-inf")).softmax(-1), v)

    sdpa = F.scaled_dot_product_attention
    runs = [
        ("SDPA, bool mask, K/V slab views", lambda: sdpa(q, k, v, attn_mask=mask, scale=scale)),
        ("SDPA, no mask", lambda: sdpa(q, k, v, scale=scale)),
        ("SDPA, contiguous K/V", lambda: sdpa(q, kc, vc, attn_mask=mask, scale=scale)),
        (
            "SDPA, 4 query heads, enable_gqa",
            lambda: sdpa(q4, k, v, attn_mask=mask, scale=scale, enable_gqa=True),
        ),
        ("written out (matmul, mask, softmax, matmul)", written_out),
        ("q . k^T alone (128 matrices 2x32x150)", lambda: torch.matmul(q, k.transpose(-1, -2))),
        ("MLP projection 64x128 @ 128x384", lambda: F.linear(h, w)),
        ("sum over 5 MB (the read rate)", big.sum),
    ]
    with torch.inference_mode():
        return [(name, per_call_us(fn, calls)) for name, fn in runs]


def engines(repeats: int) -> dict[str, list[float]]:
    import copy

    from transformers import AutoModelForCausalLM

    from weir.engine import SamplingParams
    from weir.engine.process_engine import ProcessEngine
    from weir.tasks.tiny_model import build_tiny_model

    tmp = tempfile.mkdtemp()
    build_tiny_model(tmp, "tiny", arch="qwen3")
    model = AutoModelForCausalLM.from_pretrained(tmp).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 262, (40,), generator=g).tolist() for _ in range(8)]
    params = SamplingParams(n=8, max_new_tokens=128, seed=1)
    kw = {"eos_token_ids": [], "pad_token_id": 0, "num_threads": 1}
    one = ProcessEngine(copy.deepcopy(model), **kw)
    halves = [ProcessEngine(copy.deepcopy(model), **kw) for _ in range(2)]
    arms = {
        "one engine, 64 rows": [(one, prompts)],
        "two engines at once, 32 rows each": [(halves[0], prompts[:4]), (halves[1], prompts[4:])],
        "one engine, 32 rows (alone)": [(halves[0], prompts[:4])],
    }

    def generate(parts) -> float:
        t0 = time.perf_counter()
        futures = [f for e, ps in parts for f in e.submit_many(ps, params)]
        for f in futures:
            f.result()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for parts in arms.values():
            generate(parts)  # warm-up
        for _ in range(repeats):
            for name, parts in arms.items():
                times[name].append(generate(parts))
    finally:
        for e in (one, *halves):
            e.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--calls", type=int, default=500, help="calls per piece in part 1")
    ap.add_argument("--repeats", type=int, default=4, help="alternating generations in part 2")
    ap.add_argument("--skip-engines", action="store_true", help="part 1 only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    print(f"torch {torch.__version__}, CPU {torch.backends.cpu.get_cpu_capability()}, 1 thread")
    print(f"{'one layer of a B decode step, per call':<48}{'us':>8}")
    for name, us in pieces(args.calls):
        print(f"{name:<48}{us:8.0f}")
    if not args.skip_engines:
        print(f"\nB's generation (64 rows x 128 tokens), s, median (range) of {args.repeats}:")
        for name, ts in engines(args.repeats).items():
            print(f"{name:<48}{statistics.median(ts):8.3f} ({min(ts):.3f}-{max(ts):.3f})")
    print(f"\nload average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
