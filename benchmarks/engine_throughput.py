"""Generation throughput: weir's TorchEngine against `transformers`' `model.generate`, and with
``--vllm`` a vLLM server (engine.type=vllm: .venv-vllm, streamed over HTTP, one request per sample).

Both sample the same batch of prompts on the same freshly built tiny model (CPU, float32), with the
same temperature, no top-k/top-p, the same max_new_tokens and the same set of stop tokens. A randomly
initialised model almost never emits its EOS, so to get the EOS-ending mix of lengths that RL rollouts
have, ``--extra-stops`` more token ids also end a response (for both engines), giving lengths from 1
to max_new_tokens.

Tokens are counted honestly: for HF, each returned row up to and including its first stop token
(HF keeps decoding finished rows as padding; those are not counted); for weir, the completion lengths.
Each engine runs once untimed (warm-up), then ``--repeats`` timed runs, alternating; the median is
reported.

    python benchmarks/engine_throughput.py                      # tiny, 64 prompts x n=4, 32 tokens
    python benchmarks/engine_throughput.py --size small --n 8 --max-new-tokens 64
    python benchmarks/engine_throughput.py --vllm                # adds vLLM rows (make setup-vllm)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from weir.engine import SamplingParams, TorchEngine
from weir.tasks.tiny_model import build_tiny_model


def make_prompts(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    # Byte tokens only (ids >= 6 are the tokenizer's bytes; 0-5 are special tokens).
    return [torch.randint(6, vocab, (n,), generator=g).tolist() for n in lengths]


def run_hf(model, prompts, args, stops: list[int]) -> tuple[int, float]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    if args.temperature > 0:
        sampling = dict(
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            num_return_sequences=args.n,
        )
    else:  # HF's greedy search returns one sequence per input row: repeat the rows instead
        ids, mask = ids.repeat_interleave(args.n, 0), mask.repeat_interleave(args.n, 0)
        sampling = dict(do_sample=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=args.max_new_tokens,
            eos_token_id=stops,
            pad_token_id=0,
            **sampling,
        )
    dt = time.perf_counter() - t0
    gen = out[:, width:]
    is_stop = torch.isin(gen, torch.tensor(stops))
    # Tokens up to and including the first stop token of each row (all of them if none).
    lengths = torch.where(
        is_stop.any(1), is_stop.int().argmax(1) + 1, torch.full((gen.shape[0],), gen.shape[1])
    )
    return int(lengths.sum()), dt


def run_weir(engine, prompts, args, stops: list[int]) -> tuple[int, float]:
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=stops[1:],
    )
    t0 = time.perf_counter()
    results = engine.generate_many(prompts, params)
    dt = time.perf_counter() - t0
    engine.last_results = results
    return sum(len(c.token_ids) for comps in results for c in comps), dt


@torch.inference_mode()
def logprob_mismatch(model, prompts, results, temperature: float) -> tuple[float, float]:
    """Mean and max |engine log-prob - trainer log-prob| over every generated token, the trainer's
    being log_softmax(logits / T) of one full forward of prompt + completion (weir's convention)."""
    t = temperature if temperature > 0 else 1.0
    diffs = []
    for p, comps in zip(prompts, results, strict=True):
        for c in comps:
            if not c.token_ids:
                continue
            logits = model(torch.tensor([p + c.token_ids])).logits[0].float()
            lp = torch.log_softmax(logits[len(p) - 1 : -1] / t, dim=-1)
            ref = lp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            diffs.append((torch.tensor(c.logprobs) - ref).abs())
    d = torch.cat(diffs)
    return d.mean().item(), d.max().item()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="tiny", choices=["nano", "tiny", "small"])
    ap.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--extra-stops", type=int, default=16, help="token ids that also end a response"
    )
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm", action="store_true", help="also time a vLLM server (.venv-vllm)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tmpdir = tempfile.TemporaryDirectory()
    tmp = tmpdir.name
    build_tiny_model(tmp, size=args.size, arch=args.arch, seed=args.seed)
    model = AutoModelForCausalLM.from_pretrained(tmp).eval()
    vocab = model.config.vocab_size
    eos = int(model.config.eos_token_id)
    g = torch.Generator().manual_seed(args.seed + 1)
    extra = (torch.randperm(vocab - 6, generator=g)[: args.extra_stops] + 6).tolist()
    stops = [eos] + extra
    prompts = make_prompts(args.prompts, args.min_prompt, args.max_prompt, vocab, args.seed)

    engine = TorchEngine(
        model,
        eos_token_ids=[eos],
        pad_token_id=0,
        max_batch_size=args.max_batch_size,
        seed=args.seed,
    )
    server = start_vllm_server(tmp, args, eos) if args.vllm else None
    try:
        run_hf(model, prompts, args, stops)  # warm-up
        run_weir(engine, prompts, args, stops)
        if server is not None:
            run_weir(server, prompts, args, stops)
        hf, weir, vllm = [], [], []
        for _ in range(args.repeats):
            hf.append(run_hf(model, prompts, args, stops))
            weir.append(run_weir(engine, prompts, args, stops))
            if server is not None:
                vllm.append(run_weir(server, prompts, args, stops))
    finally:
        engine.close()
        if server is not None:
            server.close()
        tmpdir.cleanup()

    def summary(runs: list[tuple[int, float]]) -> tuple[float, float, float]:
        toks = statistics.median(t for t, _ in runs)
        secs = statistics.median(s for _, s in runs)
        rate = statistics.median(t / s for t, s in runs)
        return toks, secs, rate

    n_params = sum(p.numel() for p in model.parameters())
    rows = len(prompts) * args.n
    print(
        f"model {args.arch}/{args.size} ({n_params / 1e6:.2f}M params), {len(prompts)} prompts of "
        f"{args.min_prompt}-{args.max_prompt} tokens x n={args.n} = {rows} samples, "
        f"temperature {args.temperature}, max_new_tokens {args.max_new_tokens}, "
        f"{len(stops)} stop ids, torch threads {torch.get_num_threads()}, median of {args.repeats}"
    )
    hf_t, hf_s, hf_r = summary(hf)
    w_t, w_s, w_r = summary(weir)
    print(f"{'engine':<22}{'tokens':>8}{'mean len':>10}{'seconds':>10}{'tokens/s':>11}")
    print(
        f"{'transformers generate':<22}{hf_t:>8.0f}{hf_t / rows:>10.1f}{hf_s:>10.3f}{hf_r:>11.0f}"
    )
    print(f"{'weir TorchEngine':<22}{w_t:>8.0f}{w_t / rows:>10.1f}{w_s:>10.3f}{w_r:>11.0f}")
    if vllm:
        v_t, v_s, v_r = summary(vllm)
        print(f"{'vLLM server (HTTP)':<22}{v_t:>8.0f}{v_t / rows:>10.1f}{v_s:>10.3f}{v_r:>11.0f}")
        mean, worst = logprob_mismatch(model, prompts, server.last_results, args.temperature)
        print(f"vLLM |logprob - trainer's|: mean {mean:.2e}, max {worst:.2e}")
        mean, worst = logprob_mismatch(model, prompts, engine.last_results, args.temperature)
        print(f"TorchEngine |logprob - trainer's|: mean {mean:.2e}, max {worst:.2e}")
    print(f"speed-up (tokens/s): {w_r / hf_r:.2f}x")


def start_vllm_server(model_dir: str, args, eos: int):
    """A vLLM server on the same model directory, through weir's engine.type=vllm."""
    from weir.config.schema import EngineConfig
    from weir.engine.vllm_engine import start_vllm

    cfg = EngineConfig(type="vllm", max_model_len=args.max_prompt + args.max_new_tokens + 8)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # vLLM's own device
    return start_vllm(
        cfg, model_dir, f"{model_dir}/engine", eos_token_ids=[eos], dtype=dtype, seed=args.seed
    )


if __name__ == "__main__":
    main()
