"""What runs with what: the compatibility matrix, generated from the config validator.

Every feature is a set of config overrides; every placement a cluster and an engine. A combination
is "runs" when the config validator (and the run-time check of a vision-language model,
`weir.loop.components._check_vision_run`) accepts it, else the refusal's own message, which says
why it is impossible. `weir config-docs` writes the result to docs/compatibility.md, so the page
and the code cannot disagree.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable

from weir.config import ConfigError, build_config

SEPARATE = [
    "rollout.function=weir.rollout.multi_agent:rollout",
    "multi_agent.roles=[{name: a}, {name: b}]",
    "multi_agent.policies=separate",
]
FEATURES: dict[str, list[str]] = {
    "LoRA, merged weights to the engines": ["lora.enabled=true"],
    "LoRA, adapter alone to the engines": ["lora.enabled=true", "lora.sync=adapter"],
    "critic (algo.advantage=gae)": ["algo.advantage=gae"],
    "critic sharing the policy's backbone": ["algo.advantage=gae", "critic.shared_backbone=true"],
    "asynchronous loop": ["loop.mode=async"],
    "separate policies (multi_agent)": SEPARATE,
    "top-p / top-k sampling": ["rollout.top_p=0.9", "rollout.top_k=20"],
    "vision-language model": [],  # the model decides: checked by _check_vision_run
    "built-in engine in a child process": ["engine.process=true"],
    "run.deterministic": ["run.deterministic=true"],
    "weights by disk": ["cluster.weight_sync=disk"],
    "weights by Ray's object store": ["cluster.weight_sync=object_store"],
    "colocated on GPUs": [
        "cluster.colocate=true",
        "cluster.trainer.gpus_per_rank=1",
        "cluster.engines.gpus=0.5",
    ],
    "engine.urls (servers started elsewhere)": ["engine.urls=[http://h:8000, http://h:8001]"],
    "verify every sync (cluster.verify_sync)": ["cluster.verify_sync=true"],
}
PLACEMENTS: dict[str, list[str]] = {
    "local, torch": ["cluster.type=local", "engine.type=torch"],
    "local, vLLM": ["cluster.type=local", "engine.type=vllm"],
    "local, SGLang": ["cluster.type=local", "engine.type=sglang"],
    "Ray, torch": ["cluster.type=ray", "engine.type=torch"],
    "Ray, vLLM": ["cluster.type=ray", "engine.type=vllm"],
    "Ray, SGLang": ["cluster.type=ray", "engine.type=sglang"],
}
RAY_ONLY = {
    "weights by disk",
    "weights by Ray's object store",
    "colocated on GPUs",
    "verify every sync (cluster.verify_sync)",
}
"""Settings of the Ray cluster: one process has no weight sync to choose or check."""
SERVERS_ONLY = {"engine.urls (servers started elsewhere)"}
"""Settings of server engines (vLLM, SGLang): weir's own engine has no URL."""
BASE = ["data.task=arithmetic"]


@functools.cache
def refusal(overrides: tuple[str, ...], vision: bool = False) -> str | None:
    """None when the config of `overrides` is accepted, else the refusal's message."""
    from weir.loop.components import _check_vision_run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = build_config({}, [*BASE, *overrides])
            if vision:
                _check_vision_run(cfg)
        except (ConfigError, ValueError) as err:
            text = str(err).splitlines()[-1]
            return text.split("Value error, ", 1)[-1].strip()
    return None


def _check(feature: str, placement: str, extra: list[str] = ()) -> str | None:
    over = (*PLACEMENTS[placement], *FEATURES[feature], *extra)
    return refusal(over, vision=feature == "vision-language model")


def _not_applicable(feature: str, placement: str) -> str | None:
    if feature in RAY_ONLY and placement.startswith("local"):
        return "(Ray only)"
    if feature in SERVERS_ONLY and placement.endswith("torch"):
        return "(servers only)"
    return None


def compatibility_matrix(check: Callable[..., str | None] = _check) -> str:
    """docs/compatibility.md: features by placement, pairs of features refused somewhere, and
    every refusal with its reason."""
    notes: dict[str, int] = {}

    def mark(why: str | None, applies: str | None = None) -> str:
        if applies is not None:
            return applies
        if why is None:
            return "runs"
        notes.setdefault(why, len(notes) + 1)
        return f"refused [{notes[why]}](#r{notes[why]})"

    lines = [
        "# What runs with what",
        "",
        "Generated from the config validator by `weir config-docs`; do not edit by hand. A",
        "combination the validator accepts runs; every refusal links to its message, which says",
        "why the combination is impossible. Features live in the pieces that own them (LoRA and",
        "the critic in the trainer ranks, sampling in the engines, roles in the rollout), so they",
        "do not depend on the placement: see [distributed.md](distributed.md) and",
        "[engines.md](engines.md). tests/cluster/test_matrix_on_ray.py runs every pair of",
        "{torch, vLLM} x {full, LoRA} x {GRPO, critic} x {sync, async} x {one policy, separate",
        "policies} on a Ray cluster in CI.",
        "",
        "## Features by placement",
        "",
        "| feature | " + " | ".join(PLACEMENTS) + " |",
        "| --- | " + " | ".join("---" for _ in PLACEMENTS) + " |",
    ]
    for feature in FEATURES:
        cells = [mark(check(feature, p), _not_applicable(feature, p)) for p in PLACEMENTS]
        lines.append(f"| {feature} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Pairs of features",
        "",
        "Every pair of features that some placement accepts one by one, refused together there:",
        "",
        "| feature | with | where | |",
        "| --- | --- | --- | --- |",
    ]
    pairs = 0
    for a, b in itertools.combinations(FEATURES, 2):
        for p in PLACEMENTS:
            if _not_applicable(a, p) or _not_applicable(b, p):
                continue
            if check(a, p) is not None or check(b, p) is not None:
                continue
            why = (
                check(a, p, FEATURES[b])
                if b != "vision-language model"
                else check(b, p, FEATURES[a])
            )
            if why is not None:
                lines.append(f"| {a} | {b} | {p} | {mark(why)} |")
                pairs += 1
    if not pairs:
        lines.append("| (none) | | | |")
    lines += ["", "## Every refusal", ""]
    for why, n in notes.items():
        lines += [f'<a id="r{n}"></a>{n}. {why}', ""]
    return "\n".join(lines)


__all__ = ["FEATURES", "PLACEMENTS", "compatibility_matrix", "refusal"]
