"""Engine-vs-trainer log-prob mismatch on a tiny mixture-of-experts model, with and without routing
replay (`algo.routing_replay`), and what the recorded routing costs per token.

    python benchmarks/routing_replay.py --seeds 0 1 2

The model: weir's tiny Qwen3-MoE (`weir.tasks.tiny_archs`) widened to 8 experts, top-2, 4 MoE
layers, random init. The engine (weir's `TorchEngine`, recording routing) samples 16 prompts x 4
responses of 32 tokens; the trainer (`Actor`, float32) recomputes the log-probs of those tokens
with its own routers and replaying the engine's. Two engines:

- `bf16 engine`: the engine in bfloat16, the trainer in float32 (the usual GPU setting: a bf16
  rollout engine, fp32 master weights): router logits that are close rank differently;
- `fp32 engine`: both in float32, other batch shapes only (rounding-level differences).

Reported per setting: the share of (token, layer) router decisions where the trainer's own top-k
set differs from the engine's, and the mean / max |log pi_trainer - log pi_engine| over the
sampled tokens without and with replay. Then the recorded routing's size per token for this model
and for real models' configs.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import AutoModelForCausalLM

from weir.config import build_config
from weir.data.moe_routing import RoutingSpec, install_routing, recording
from weir.data.sample import Group, Sample
from weir.engine import SamplingParams, TorchEngine
from weir.tasks.tiny_archs import arch_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.response_rows import left_pad

# model: (MoE layers, top-k, experts, KV bytes per token in bf16) from the published config.json
REAL = {
    "Qwen3-30B-A3B": (48, 8, 128, 48 * 2 * 4 * 128 * 2),
    "Qwen3-235B-A22B": (94, 8, 128, 94 * 2 * 4 * 128 * 2),
    "gpt-oss-20b": (24, 4, 32, 24 * 2 * 8 * 64 * 2),
    "gpt-oss-120b": (36, 4, 128, 36 * 2 * 8 * 64 * 2),
    "DeepSeek-V3": (58, 8, 256, 61 * (512 + 64) * 2),  # MLA: one latent of 576 per layer
}


def build(seed: int) -> torch.nn.Module:
    cfg = arch_config(
        "qwen3_moe",
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        hidden_size=64,
        head_dim=16,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def sample(engine_model, seed: int) -> list[Group]:
    engine = TorchEngine(
        engine_model, eos_token_ids=[], pad_token_id=0, seed=seed, record_routing=True
    )
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(6, 262, (int(n),), generator=g).tolist() for n in range(8, 24)]
    try:
        outs = engine.generate_many(
            prompts, SamplingParams(n=4, max_new_tokens=32, temperature=1.0, seed=seed)
        )
    finally:
        engine.close()
    return [
        Group(
            samples=[
                Sample(
                    prompt_ids=p,
                    response_ids=c.token_ids,
                    rollout_logprobs=c.logprobs,
                    versions=c.versions,
                    reward=float(i % 2),
                    group_id=gid,
                    index=i,
                    routed_experts=c.routed_experts,
                )
                for i, c in enumerate(comps)
            ],
            group_id=gid,
        )
        for gid, (p, comps) in enumerate(zip(prompts, outs, strict=True))
    ]


def flipped_share(model, spec: RoutingSpec, batch) -> float:
    """Share of (token, layer) decisions whose expert set the trainer's own routers choose
    differently from the engine's record (tokens the engine ran)."""
    seqs = [s.prompt_ids + s.response_ids for s in batch.samples]
    ids, attn, pos = left_pad(seqs)
    with torch.no_grad(), recording(spec) as rec:
        model(input_ids=ids, attention_mask=attn, position_ids=pos)
    own = rec.stacked(*ids.shape).long()
    width = ids.shape[1]
    differ = total = 0
    for i, s in enumerate(batch.samples):
        r = s.routed_experts.long()
        mine = own[i, width - len(seqs[i]) : width - len(seqs[i]) + r.shape[0]]
        same = (mine.sort(-1).values == r.sort(-1).values).all(-1)
        differ += int((~same).sum())
        total += same.numel()
    return differ / total


def measure(seed: int, engine_dtype: torch.dtype) -> dict[str, float]:
    trainer = build(seed)
    engine_model = copy.deepcopy(trainer).to(engine_dtype)
    batch = make_batch(sample(engine_model, seed), version=0)
    cfg = build_config(
        {},
        [
            "algo.routing_replay=true",
            "train.packing=padded",
            "rollout.n=4",
            "rollout.batch_prompts=16",
        ],
    )
    actor = Actor(trainer, ActorSettings.from_config(cfg))
    m = batch.response_mask.bool()
    out = {"flipped": flipped_share(actor.model, actor.routing, batch)}
    for name, replay in (("own", False), ("replay", True)):
        d = (actor.logprobs(actor.model, batch, replay=replay) - batch.rollout_logprobs)[m].abs()
        out[f"{name}_mean"], out[f"{name}_max"] = float(d.mean()), float(d.max())
    return out


def rng(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}} - {hi:{fmt}}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    print(
        "| engine | router decisions flipped | mean abs dlogp, own routing | with replay | "
        "max abs dlogp, own routing | with replay |\n|---|---|---|---|---|---|"
    )
    for label, dtype in (
        ("bf16 engine, fp32 trainer", torch.bfloat16),
        ("fp32 engine", torch.float32),
    ):
        rows = [measure(s, dtype) for s in args.seeds]
        cols = [
            rng([r[k] for r in rows], f)
            for k, f in (
                ("flipped", ".2%"),
                ("own_mean", ".2e"),
                ("replay_mean", ".2e"),
                ("own_max", ".2e"),
                ("replay_max", ".2e"),
            )
        ]
        print(f"| {label} | " + " | ".join(cols) + " |")
    spec = install_routing(build(0))
    print(f"\nseeds {args.seeds}, {time.perf_counter() - t0:.0f} s\n")
    print(
        "| model | MoE layers x top-k | index dtype | routing bytes / token | KV cache bytes / token (bf16) | routing / KV |"
    )
    print("|---|---|---|---|---|---|")
    tiny = RoutingSpec("qwen3_moe", spec.layers, spec.top_k, spec.experts)
    print(
        f"| this tiny model | {spec.layers} x {spec.top_k} | {tiny.dtype} | {tiny.bytes_per_token} | – | – |"
    )
    for name, (layers, k, experts, kv) in REAL.items():
        s = RoutingSpec("", layers, k, experts)
        print(
            f"| {name} | {layers} x {k} | {str(s.dtype).removeprefix('torch.')} | "
            f"{s.bytes_per_token} | {kv} | {s.bytes_per_token / kv:.2%} |"
        )


if __name__ == "__main__":
    main()
