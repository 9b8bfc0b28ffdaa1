"""Per architecture (weir.tasks.tiny_archs), over several seeds: how far the engine's log-probs are
from a plain HF forward with its masks, and without the sliding window (what weir did before it
masked windows); how far packed log-probs are from unpacked ones; and what the start-up self-check
costs. The figures in docs/models.md come from this script.

    python benchmarks/arch_parity.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from weir.engine import SamplingParams, TorchEngine
from weir.engine.support import ModelSupport, model_support
from weir.loop.selfcheck import run_selfcheck
from weir.tasks.tiny_archs import ARCHS, WINDOW, arch_config
from weir.train.packing import packed_response_logprobs


@torch.inference_mode()
def _err(model, prompts, results) -> float:
    errs = []
    for prompt, comps in zip(prompts, results, strict=True):
        for c in comps:
            toks = list(c.token_ids)
            logits = model(torch.tensor([prompt + toks])).logits[0].float()
            lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
            ref = lp.gather(1, torch.tensor(toks)[:, None]).squeeze(1)
            errs.append((ref - torch.tensor(c.logprobs)).abs().mean().item())
    return sum(errs) / len(errs)


def measure(name: str, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(arch_config(name)).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(6, 262, (k,), generator=g).tolist() for k in (5, 13, 21)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4 * WINDOW, seed=seed)
    support = model_support(model.config)
    out: dict[str, float] = {}
    with TorchEngine(model, eos_token_ids=[], pad_token_id=0, num_threads=1) as engine:
        out["engine"] = _err(model, prompts, engine.generate_many(prompts, params))
        if support.sliding_windows():
            engine._support = ModelSupport(
                support.model_type, support.name, dict.fromkeys(support.windows), True
            )
            out["no_window"] = _err(model, prompts, engine.generate_many(prompts, params))
            engine._support = support

        class Train:
            packing = "auto"

        t0 = time.perf_counter()
        result = run_selfcheck(model, engine, Train())
        out["selfcheck_s"] = time.perf_counter() - t0
    seqs = [torch.randint(6, 262, (k,), generator=g).tolist() for k in (40, 40)]
    lens = [39, 39]
    with torch.no_grad():
        packed = packed_response_logprobs(model, seqs, lens).logprobs[1]
        alone = packed_response_logprobs(model, seqs[1:], lens[1:]).logprobs[0]
    out["packed"] = (packed - alone).abs().mean().item()
    out["fallback"] = float(result.packing == "padded")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("arch | engine err | err without window | packed err | self-check s (min-max)")
    for name in sorted(ARCHS):
        runs = [measure(name, s) for s in args.seeds]

        def rng(key: str, fmt: str = ".2g", runs: list[dict[str, float]] = runs) -> str:
            vals = [r[key] for r in runs if key in r]
            return f"{min(vals):{fmt}}-{max(vals):{fmt}}" if vals else "-"

        print(
            f"{name} | {rng('engine')} | {rng('no_window')} | {rng('packed')} | "
            f"{rng('selfcheck_s', '.2f')} | fallback={rng('fallback', '.0f')}"
        )


if __name__ == "__main__":
    main()
