"""KV-cache memory of the built-in engine: exact accounting, a budget, and the capacity policy.

The engine keeps every sequence's keys and values in slabs ``[rows, kv_heads, columns, head_dim]``, one
for the keys and one for the values of each layer. One *cell* (one row x one column) therefore costs

    cell_bytes = 2 * num_layers * kv_heads * head_dim * element_size

and a slab set of ``R`` rows and ``C`` columns costs ``R * C * cell_bytes``. The budget, the admission
decisions and the tests all use this arithmetic, so they behave the same on a CPU and on a GPU.

`KVMeter` measures what is really alive: every KV tensor the engine allocates is registered with a
finalizer, so ``live`` drops when the tensor is garbage (not when the engine believes it dropped it),
and ``peak`` is the high-water mark. `plan_slabs` is the capacity policy: grow geometrically (doubling
rows and columns) when the budget allows it, so that most admissions reuse the slabs in place, and
fall back to the exact need when it does not.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass

import torch

from weir.hf_compat import cache_kwargs

__all__ = [
    "KVBudgetError",
    "KVMeter",
    "KVState",
    "SlabPlan",
    "cell_bytes",
    "measure_cell_bytes",
    "current_meter",
    "bind_meter",
    "plan_slabs",
    "resolve_budget",
]

GB = 1024**3


class KVBudgetError(ValueError):
    """A request needs more KV cache than the engine's budget can ever give it."""


def cell_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token of one sequence occupies across all layers (keys and values)."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * size


@torch.no_grad()
def measure_cell_bytes(model: torch.nn.Module, token_id: int = 0) -> int:
    """Bytes of KV cache one token of one sequence occupies, read off the model's own cache after a
    one-token forward. Unlike `cell_bytes` this holds for any layout the model caches (e.g. MLA,
    whose keys and values have different widths and as many heads as queries)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    model(
        input_ids=torch.tensor([[token_id]], device=device),
        use_cache=True,
        logits_to_keep=1,
        **cache_kwargs(model, cache),
    )
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (layer.keys, layer.values)
        if t is not None
    )


def resolve_budget(gb: float | None, fraction: float | None, device: torch.device) -> int | None:
    """The KV budget in bytes: `gb` GiB, or `fraction` of the memory free on `device` now (CUDA:
    ``torch.cuda.mem_get_info``; CPU: the available physical memory). None: no budget."""
    if gb is not None and fraction is not None:
        raise ValueError("set engine.kv_budget_gb or engine.kv_budget_fraction, not both")
    if gb is not None:
        if gb <= 0:
            raise ValueError(f"engine.kv_budget_gb must be > 0, got {gb}")
        return int(gb * GB)
    if fraction is None:
        return None
    if not 0 < fraction <= 1:
        raise ValueError(f"engine.kv_budget_fraction must be in (0, 1], got {fraction}")
    return int(fraction * free_memory(device))


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class KVMeter:
    """Bytes of KV tensors alive now (``live``), their high-water mark (``peak``), and counters.

    A tensor is counted from `track` until the tensor object is collected (a weakref finalizer), so a
    slab that something still references keeps counting.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0
        self.allocations = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        with self._lock:
            self.live += nbytes
            self.allocations += 1
            self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, nbytes)
        return t

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live


_bound = threading.local()


def bind_meter(meter: KVMeter | None) -> None:
    """Make `meter` the one KV slabs allocated on this thread are counted by (the engine thread)."""
    _bound.meter = meter


def current_meter() -> KVMeter | None:
    return getattr(_bound, "meter", None)


@dataclass(frozen=True)
class SlabPlan:
    """Slab capacity for a join: ``rows`` x ``cols``; ``peak`` is the most KV bytes alive meanwhile."""

    rows: int
    cols: int
    peak: int
    realloc: bool


def realloc_peak(live: int, old_bytes: int, new_bytes: int, tensors: int) -> int:
    """Most bytes alive while `tensors` old slabs (``old_bytes`` in all) are replaced one by one by
    new ones (``new_bytes`` in all), each old one freed once its rows are copied:
    ``live + n + j * (n - o)`` after allocating new tensor j, largest at j = 0 or j = tensors - 1."""
    o, n = old_bytes // tensors, new_bytes // tensors
    return live + n + max(0, (tensors - 1) * (n - o))


def plan_slabs(
    *,
    need_rows: int,
    need_cols: int,
    cap_rows: int,
    cap_cols: int,
    max_rows: int,
    max_cols: int,
    live: int,
    old_bytes: int,
    cell: int,
    tensors: int,
    budget: int | None,
    copy_old: bool,
) -> SlabPlan | None:
    """Where a join puts its rows: the current slabs when they are large enough, else new ones.

    New slabs double the capacity that ran out (``max(need, 2 * old)``, capped at ``max_rows`` /
    ``max_cols`` unless the need itself is larger), so that ``k`` admissions of growing need cost
    O(log k) reallocations. Under a budget, the largest capacity that fits on the way from "the
    exhausted dimension at its need, the other at its current capacity" to doubled, else from the
    exact need to that point (1/64 steps); after the join the slabs plus one slab's worth of
    scratch (row moves) must fit too. `live` counts every KV byte alive now, the current
    slabs (``old_bytes``) included. With `copy_old` the live rows move to the new slabs tensor by
    tensor (`realloc_peak`); without, the old slabs are freed first. None: nothing fits, wait.
    """
    if need_rows <= cap_rows and need_cols <= cap_cols:
        peak = live + (old_bytes // tensors if old_bytes else 0)  # an in-place move's scratch
        return SlabPlan(cap_rows, cap_cols, peak, False) if _fits(peak, budget) else None
    rows_g = max(need_rows, min(2 * cap_rows, max_rows)) if need_rows > cap_rows else cap_rows
    cols_g = max(need_cols, min(2 * cap_cols, max_cols)) if need_cols > cap_cols else cap_cols
    rows_x, cols_x = max(need_rows, 1), max(need_cols, 1)
    # The dimension that did not run out keeps its capacity if it can (no shape thrash).
    rows_k, cols_k = max(rows_x, min(cap_rows, rows_g)), max(cols_x, min(cap_cols, cols_g))

    def plan(rows: int, cols: int) -> SlabPlan | None:
        new_bytes = rows * cols * cell
        if copy_old and old_bytes:
            peak = realloc_peak(live, old_bytes, new_bytes, tensors)
        else:
            peak = live - old_bytes + new_bytes
        after = live - old_bytes + new_bytes + new_bytes // tensors
        ok = _fits(peak, budget) and _fits(after, budget)
        return SlabPlan(rows, cols, peak, True) if ok else None

    def largest(lo_rc: tuple[int, int], hi_rc: tuple[int, int]) -> SlabPlan | None:
        """The largest fitting plan on the segment lo -> hi (1/64 steps; bytes grow along it)."""

        def at(step: int) -> SlabPlan | None:
            return plan(
                lo_rc[0] + (hi_rc[0] - lo_rc[0]) * step // _STEPS,
                lo_rc[1] + (hi_rc[1] - lo_rc[1]) * step // _STEPS,
            )

        best = at(_STEPS)
        if best is not None or at(0) is None:
            return best
        lo, hi = 0, _STEPS  # at(lo) fits, at(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if at(mid) is not None else (lo, mid)
        return at(lo)

    return largest((rows_k, cols_k), (rows_g, cols_g)) or largest(
        (rows_x, cols_x), (rows_k, cols_k)
    )


_STEPS = 64


def _fits(nbytes: int, budget: int | None) -> bool:
    return budget is None or nbytes <= budget


@dataclass
class KVState:
    """One engine's KV settings and counters, shared by its running batches."""

    cell: int
    """Bytes per cell (`cell_bytes`)."""
    tensors: int
    """Slabs per slab set: 2 per layer."""
    budget: int | None
    max_cols: int
    meter: KVMeter
    reallocs: int = 0
    """New slab sets allocated for the running batch."""
    moves: int = 0
    """In-place moves of the live columns (the right edge ran out, the capacity did not)."""
    releases: int = 0
    """Times the slabs were given back (idle, sleep)."""
    copied_bytes: int = 0
    """KV bytes of live rows copied by reallocations and moves (not the newcomers' own KV)."""


def kv_options(engine_cfg) -> dict:
    """`TorchEngine` keyword arguments from an `engine:` config section."""
    return {
        "kv_budget_gb": engine_cfg.kv_budget_gb,
        "kv_budget_fraction": engine_cfg.kv_budget_fraction,
        "kv_idle_release_s": engine_cfg.kv_idle_release_s,
        "prefix_cache": engine_cfg.prefix_cache,
        "share_prefixes": engine_cfg.share_prefixes,
        "recompute_kv_on_update": engine_cfg.kv_on_update == "recompute",
        "cuda_graphs": engine_cfg.cuda_graphs,
    }
