"""Routing replay (R3) for mixture-of-experts models: the engine records which experts each MoE
layer's router picked for every token it ran, and the trainer's forward uses those picks instead
of its own router's.

Why: the engine and the trainer compute a router's logits with other kernels, in other batches, in
other precisions. Where two experts' logits are close, the two may pick different experts for the
same token, and that token's output (and every later token's, through attention) is then not the
same function in the two: a mismatch no importance weight corrects well. Replaying the engine's
picks makes the trainer compute the engine's function (Ma et al. 2025, "Stabilizing MoE
Reinforcement Learning by Aligning Training and Inference Routers"; slime, verl, miles).

How: a forward hook on each router module (the modules of `ROUTERS`, by class name) of a model.
What it does depends on the calling thread's state, so that one module can serve a colocated engine
and trainer:

- `recording()`: the hook stores the router's top-k indices; `Recorder.stacked` returns them as
  ``[rows, columns, layers, k]`` for the forward's ``input_ids [rows, columns]``;
- `replaying(indices)`: ``indices [tokens, layers, k]`` (int64, the forward's tokens in
  ``input_ids.flatten()`` order; a row of -1 keeps the router's own pick for that token). The hook
  returns the recorded indices and gate weights recomputed from the trainer's own router logits at
  those indices, exactly as the router computes them from its own picks (`ROUTERS`), so the
  gradient still reaches the router's weights through the gate weights;
- neither: the hook changes nothing.

Activation checkpointing reruns a layer's forward during backward, outside `replaying`: the
trainer's checkpoint function takes `checkpoint_context` (torch's ``context_fn``), which restores
the state of the forward for the recomputation.

Storage: ``uint8`` indices where the model has at most 256 experts per layer (DeepSeek-V3: 256),
else ``int16``: ``layers * k`` bytes per token (Qwen3-30B-A3B: 48 x 8 = 384).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ROUTERS",
    "Recorder",
    "RoutingSpec",
    "UnsupportedRouting",
    "checkpoint_context",
    "install_routing",
    "recording",
    "replaying",
]


class UnsupportedRouting(ValueError):
    """A model whose routing weir cannot record and replay (one line: which model, what runs)."""


def _qwen3_moe(router: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    """Qwen3MoeTopKRouter: softmax over all experts in float32, the top-k probabilities,
    renormalised over the k when ``norm_topk_prob``, cast to the logits' dtype."""
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top = probs.gather(1, idx)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def _gpt_oss(router: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    """GptOssTopKRouter: a softmax over the k selected logits."""
    top = logits.gather(1, idx)
    return F.softmax(top, dim=1, dtype=top.dtype)


def _deepseek_v3(router: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    """DeepseekV3TopkRouter: sigmoid scores of the selected experts (the group-limited choice and
    the correction bias only choose; they do not weigh), renormalised when ``norm_topk_prob``,
    times ``routed_scaling_factor``."""
    top = logits.sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * router.routed_scaling_factor


ROUTERS: dict[str, tuple[str, Callable[[nn.Module, Tensor, Tensor], Tensor]]] = {
    "qwen3_moe": ("Qwen3MoeTopKRouter", _qwen3_moe),
    "gpt_oss": ("GptOssTopKRouter", _gpt_oss),
    "deepseek_v3": ("DeepseekV3TopkRouter", _deepseek_v3),
}
"""model_type -> (the class name of its router module, its gate weights given the router logits
and the chosen expert indices: the router's own formula, as transformers writes it)."""


@dataclass(frozen=True)
class RoutingSpec:
    """The routers of one model: how many (MoE layers), their top-k and expert count."""

    model_type: str
    layers: int
    top_k: int
    experts: int

    @property
    def dtype(self) -> torch.dtype:
        """The compact storage dtype of recorded indices."""
        return torch.uint8 if self.experts <= 256 else torch.int16

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.top_k * (1 if self.dtype == torch.uint8 else 2)


class _State(threading.local):
    mode: str | None = None
    recorder: Recorder | None = None
    indices: Tensor | None = None
    seen: set[int] = set()  # noqa: RUF012  (replaced per replay; the layers whose router ran)


_STATE = _State()


class Recorder:
    """The indices the routers picked in one forward, in layer order."""

    def __init__(self, spec: RoutingSpec):
        self.spec = spec
        self.picks: list[Tensor | None] = [None] * spec.layers

    def stacked(self, rows: int, columns: int) -> Tensor:
        """``[rows, columns, layers, k]`` on the CPU in the compact dtype."""
        if any(p is None for p in self.picks):
            missing = [i for i, p in enumerate(self.picks) if p is None]
            raise RuntimeError(f"routing record: MoE layers {missing} ran no router in the forward")
        out = torch.stack(self.picks, dim=1).view(rows, columns, self.spec.layers, -1)  # type: ignore[arg-type]
        return out.to("cpu", self.spec.dtype)


def _hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
    state = _STATE
    if state.mode is None:
        return None
    logits, _, own = output
    layer = module._weir_routing_layer
    if state.mode == "record":
        state.recorder.picks[layer] = own.detach()  # type: ignore[union-attr]
        return None
    state.seen.add(layer)
    rec = state.indices[:, layer]  # type: ignore[index]
    if rec.shape[0] != own.shape[0]:
        raise RuntimeError(
            f"routing replay: {rec.shape[0]} recorded tokens for a router that saw {own.shape[0]}"
        )
    rec = rec.to(own.device)
    idx = torch.where(rec[:, :1] >= 0, rec, own)
    return logits, module._weir_routing_weights(module, logits, idx), idx


def install_routing(model: nn.Module) -> RoutingSpec:
    """Hook every router of `model` (idempotent) and return its `RoutingSpec`; `UnsupportedRouting`
    for a model without a router weir knows."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ROUTERS:
        raise UnsupportedRouting(
            f"algo.routing_replay: {type(model).__name__} ({model_type}) has no mixture-of-experts "
            f"router weir records; it runs for {', '.join(ROUTERS)}"
        )
    name, weights = ROUTERS[model_type]
    routers = [m for m in model.modules() if type(m).__name__ == name]
    if not routers:
        raise UnsupportedRouting(
            f"algo.routing_replay: {type(model).__name__} has no {name} module"
        )
    for i, router in enumerate(routers):
        router._weir_routing_layer = i
        router._weir_routing_weights = weights
        if not getattr(router, "_weir_routing_hooked", False):
            router.register_forward_hook(_hook)
            router._weir_routing_hooked = True
    first = routers[0]
    return RoutingSpec(model_type, len(routers), int(first.top_k), int(first.num_experts))


@contextlib.contextmanager
def _set(mode: str | None, recorder: Recorder | None, indices: Tensor | None) -> Iterator[None]:
    state = _STATE
    saved = (state.mode, state.recorder, state.indices)
    state.mode, state.recorder, state.indices = mode, recorder, indices
    try:
        yield
    finally:
        state.mode, state.recorder, state.indices = saved


@contextlib.contextmanager
def recording(spec: RoutingSpec) -> Iterator[Recorder]:
    """Record the routers' picks of the forwards run inside (each forward overwrites the last)."""
    rec = Recorder(spec)
    with _set("record", rec, None):
        yield rec


@contextlib.contextmanager
def replaying(indices: Tensor | None) -> Iterator[None]:
    """Replay `indices` ``[tokens, layers, k]`` (int64; -1 rows: the router's own pick) in the one
    forward run inside; None replays nothing. A forward in which a router did not run (a fused
    kernel that bypasses the router module) is an error, not a silent forward on its own routing."""
    if indices is None:
        yield
        return
    _STATE.seen = set()
    with _set("replay", None, indices):
        yield
    missing = sorted(set(range(indices.shape[1])) - _STATE.seen)
    if missing:
        raise RuntimeError(
            f"routing replay: the routers of MoE layers {missing} did not run in the forward (a "
            "fused MoE kernel bypasses them?); the replay would not apply there"
        )


def checkpoint_context() -> tuple[
    contextlib.AbstractContextManager, contextlib.AbstractContextManager
]:
    """torch.utils.checkpoint's ``context_fn``: nothing around the forward, and the forward's
    routing state around its recomputation in the backward."""
    state = _STATE
    return contextlib.nullcontext(), _set(state.mode, state.recorder, state.indices)


@dataclass
class Routes:
    """The recorded routing of a micro-batch's sequences, as the trainer's layouts read it: one
    ``[tokens, layers, k]`` tensor (or None: not recorded) per sequence, covering a prefix of it."""

    seqs: list[Tensor | None]
    layers: int
    top_k: int

    def span(self, i: int, start: int, stop: int) -> Tensor:
        """Positions ``[start, stop)`` of sequence `i` as int64 ``[stop - start, layers, k]``, -1
        where nothing was recorded (the router's own pick)."""
        out = torch.full((max(0, stop - start), self.layers, self.top_k), -1, dtype=torch.long)
        rec = self.seqs[i]
        if rec is not None:
            hi = min(stop, rec.shape[0])
            if hi > start:
                out[: hi - start] = rec[start:hi].long()
        return out

    def pad(self, n: int) -> Tensor:
        """`n` positions of padding (the router's own pick)."""
        return torch.full((n, self.layers, self.top_k), -1, dtype=torch.long)

    def left_padded(self, lengths: list[int], width: int, rows: list[int] | None = None) -> Tensor:
        """Sequences `rows` (default: all) right-aligned in `width` columns, flattened to
        ``[len(rows) * width, layers, k]`` (the order of a left-padded ``input_ids.flatten()``)."""
        rows = list(range(len(lengths))) if rows is None else rows
        parts = []
        for i, n in zip(rows, lengths, strict=True):
            parts += [self.pad(width - n), self.span(i, 0, n)]
        return torch.cat(parts)
