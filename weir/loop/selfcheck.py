"""The start-up self-check: on the actual model, before the first rollout, measure that

1. packed micro-batches give the log-probs of each sequence alone (the model keeps packed sequences
   apart when position ids restart), and
2. the engine's log-probs (prefill and decode, past any sliding window) equal the trainer's.

On a packing mismatch with ``train.packing: auto`` the run falls back to one padded row per sequence
and says so; with ``train.packing: packed`` it stops. An engine/trainer mismatch always stops: the run
would be off-policy by an amount nobody asked for. Both stop as a one-line `UnsupportedModel`.

Cost: two trainer forwards over about ``2.5 * probe_len`` tokens and one engine generation of
`NEW_TOKENS` tokens, where ``probe_len = min(max(24, window + 16), max_seq_len - 1)``: a fraction of
a second for weir's tiny models; for a 7B model with a 4096-token window, some 10k tokens of forward.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from weir.config.devices import resolve_dtype, rounding_tolerance
from weir.data.moe_routing import Routes
from weir.engine.base import SamplingParams
from weir.engine.support import SUPPORTED, UnsupportedModel, model_support
from weir.train.packing import choose_layout, packed_response_logprobs, response_logprobs
from weir.train.precision import compute_device

__all__ = ["SelfCheckResult", "check_packing", "probe_length", "run_selfcheck"]

NEW_TOKENS = 8
MIN_PROBE = 24


@dataclass
class SelfCheckResult:
    packed_err: float | None
    """Mean |packed - alone| log-prob per token (None: packing not probed, train.packing=padded)."""
    engine_err: float
    """Mean |engine - trainer| log-prob per generated token."""
    packing: str
    """The packing mode the run trains with after the check."""
    probe_len: int
    seconds: float


def _probe_tokens(vocab: int, n: int, avoid: set[int], seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < n:
        out += [t for t in torch.randint(0, vocab, (n,), generator=g).tolist() if t not in avoid]
    return out[:n]


def _say(message: str) -> None:
    print(f"weir: {message}", file=sys.stderr, flush=True)


@torch.no_grad()
def check_packing(
    model: torch.nn.Module, train_cfg: Any, vocab_size: int, avoid: set[int], probe_len: int
) -> float | None:
    """Probe 1 (packed = unpacked) on `model`; returns the mean error, None when
    ``train_cfg.packing`` is "padded" (nothing to probe). Sets it to "padded" on a mismatch under
    "auto"; raises `UnsupportedModel` under "packed"."""
    if train_cfg.packing in ("padded", "prefix", "varlen"):  # nothing to probe, or probes itself
        return None
    arch = str(getattr(model.config, "model_type", "?"))
    name = SUPPORTED[arch].name if arch in SUPPORTED else arch
    tol = rounding_tolerance(next(model.parameters()).dtype, compute_device(model))
    a = _probe_tokens(vocab_size, probe_len, avoid, seed=1)
    b = _probe_tokens(vocab_size, max(2, probe_len // 2), avoid, seed=2)
    seqs, lens = [b, a], [len(b) - 1, len(a) - 1]
    was_training = model.training
    model.eval()
    try:
        packed = packed_response_logprobs(model, seqs, lens).logprobs
        alone = [
            packed_response_logprobs(model, [s], [n]).logprobs[0]
            for s, n in zip(seqs, lens, strict=True)
        ]
    finally:
        model.train(was_training)
    diffs = [(packed[i, :n] - alone[i]).abs() for i, n in enumerate(lens)]
    err = float(torch.cat(diffs).mean())
    if err > tol:
        what = (
            f"{name} ({arch}) does not keep packed sequences apart: "
            f"packed log-probs differ from unpacked by {err:.3g} nats/token"
        )
        if train_cfg.packing == "packed":
            raise UnsupportedModel(f"{what}; set train.packing=padded (or auto)")
        train_cfg.packing = "padded"
        _say(f"self-check: {what}; training with train.packing=padded instead")
    return err


def probe_length(model: torch.nn.Module, max_seq_len: int) -> int:
    """Probe tokens: past the largest sliding window by 2 * `NEW_TOKENS`, at least `MIN_PROBE`."""
    window = getattr(model.config, "sliding_window", None)
    windows = [int(window)] if window else []
    n = max(MIN_PROBE, (max(windows) + 2 * NEW_TOKENS) if windows else 0)
    return min(n, max_seq_len - 1)


@torch.no_grad()
def run_selfcheck(model: torch.nn.Module, engine: Any, train_cfg: Any) -> SelfCheckResult:
    """Probe `model` (the trainer's module) and `engine` (a `TorchEngine`, or a `ProcessEngine`, on the same weights);
    set ``train_cfg.packing`` to "padded" when packing must be avoided. Raises `UnsupportedModel`."""
    t0 = time.perf_counter()
    support = model_support(model.config)
    p, device = next(model.parameters()), compute_device(model)
    # the loosest precision in play: master weights, the trainer's compute dtype, the engine's
    compute = resolve_dtype(getattr(train_cfg, "compute_dtype", None), device)
    engine_dtype = engine.dtype
    tol = max(rounding_tolerance(d, device) for d in (p.dtype, compute, engine_dtype))
    probe_len = probe_length(model, engine.max_seq_len)
    avoid = set(engine.eos_token_ids) | {engine.pad_token_id}
    packed_err = check_packing(model, train_cfg, engine.vocab_size, avoid, probe_len)
    prompt = _probe_tokens(engine.vocab_size, probe_len, avoid, seed=1)[: probe_len - NEW_TOKENS]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=NEW_TOKENS, seed=0)
    completion = engine.generate_many([prompt], params)[0][0]
    engine_err = 0.0
    if completion.token_ids:
        toks = list(completion.token_ids)
        was_training = model.training
        model.eval()
        try:
            routed = completion.routed_experts  # algo.routing_replay: compare like with like
            ref = response_logprobs(
                model,
                [prompt + toks],
                [len(toks)],
                layout=choose_layout(model, train_cfg.packing),
                routes=None if routed is None else Routes([routed], *routed.shape[1:]),
            ).logprobs[0]
        finally:
            model.train(was_training)
        engine_err = float(
            (ref - torch.tensor(completion.logprobs, device=ref.device)).abs().mean()
        )
    if engine_err > tol:
        raise UnsupportedModel(
            f"self-check: engine and trainer log-probs differ by {engine_err:.3g} nats/token on "
            f"{support.name} ({support.model_type}); weir cannot run this model exactly "
            "(please report it; model.selfcheck=false skips this check)"
        )
    return SelfCheckResult(
        packed_err, engine_err, train_cfg.packing, probe_len, time.perf_counter() - t0
    )
