"""Decode steps of fixed shape, replayed as CUDA graphs.

On a GPU a decode step of a small or mid-size model is bound by the host: the direct forward
(`weir.engine.decode.DecodeForward`) launches some 10-20 kernels per layer, and for a 0.5B model on an
H100 the step took 85-108 ms whatever the number of rows (docs/gpu.md), about ten times its GPU
work. A CUDA graph records the kernels of one step once and replays them with one launch.

A graph replays fixed shapes at fixed addresses, while the engine's step changes both: the rows come
and go, and every step attends to one more KV column. `StaticDecode` therefore runs the step on
fixed-size inputs:

- rows are padded up to a bucket (powers of two, at most the slabs' row capacity); a padding row
  reads token 0 at position 0 and attends only to the column being written, so that every value it
  writes into the slabs stays finite (masked columns must be finite: a NaN key times a zero weight
  is still NaN);
- the new KV column is written at a column index held in a tensor (``index_copy_``), and the
  attention reads the slabs' whole width under a mask built in the graph from tensors: row ``r``
  attends to columns ``lo[r] <= j <= w``, ``lo`` its first real column and ``w`` the column written
  (with a sliding window ``w - j < window`` as well).

One graph is kept per row bucket for the current slabs; reallocated slabs (new addresses), moved
weights (sleep with offload) or a model whose parameters were replaced drop them all. Attending to
the whole width instead of the live columns changes the order of the sums in the attention kernels,
so the logits differ from the eager step by rounding: the engine compares the two on the first
fixed-shape step and decodes eagerly from then on if they differ by more than rounding
(`weir.config.devices.rounding_tolerance`).

Without CUDA (or with ``cuda_graphs="eager"``) the same fixed-shape step runs without capture; the
tests use that to check it on a CPU against the eager engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from weir.engine.masks import additive
from weir.engine.support import ModelSupport

if TYPE_CHECKING:
    from weir.engine.decode import DecodeForward

__all__ = ["StaticDecode", "row_bucket", "static_decode"]


def row_bucket(rows: int, capacity: int) -> int:
    """The padded row count for `rows` live rows: the next power of two (at least 8), at most the
    slabs' `capacity`. Powers of two bound the graphs to about log2(capacity) per slab size."""
    bucket = 8
    while bucket < rows:
        bucket *= 2
    return min(bucket, capacity)


def static_decode(
    direct: DecodeForward | None,
    model: torch.nn.Module,
    support: ModelSupport,
    additive_dtype: torch.dtype | None,
    cuda_graphs: bool | str,
) -> StaticDecode | None:
    """The engine's fixed-shape decode: captured on a CUDA device when `cuda_graphs`, run without
    capture anywhere with ``"eager"``; None without the direct forward or with graphs off."""
    if direct is None or not cuda_graphs:
        return None
    if cuda_graphs == "eager":
        return StaticDecode(direct, model, support, additive_dtype, capture=False)
    if cuda_graphs is not True:
        raise ValueError(f"cuda_graphs must be True, False or 'eager', got {cuda_graphs!r}")
    if next(model.parameters()).device.type != "cuda" or not _static_rope(direct):
        return None
    return StaticDecode(direct, model, support, additive_dtype, capture=True)


def _static_rope(direct: DecodeForward) -> bool:
    """False for rotary embeddings that rescale their frequencies from the positions seen (HF's
    ``dynamic`` and ``longrope``): their update reads a position on the host, which a graph cannot
    replay."""
    rope = getattr(direct.rotary, "rope_type", "default")
    types = rope.values() if isinstance(rope, dict) else [rope]
    return not any("dynamic" in t or t == "longrope" for t in types)


class _Entry:
    """One bucket's fixed buffers (and its graph once captured)."""

    __slots__ = ("rows", "ids", "pos", "lo", "w", "out", "graph")

    def __init__(self, rows: int, device: torch.device):
        self.rows = rows
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.lo = torch.zeros(rows, dtype=torch.long, device=device)
        self.w = torch.zeros(1, dtype=torch.long, device=device)
        self.out: torch.Tensor | None = None
        self.graph: Any = None


class StaticDecode:
    """The engine's decode step over fixed shapes, captured as CUDA graphs when `capture`.

    `__call__(batch)` writes the step's KV column into the batch's slabs and returns the logits of
    its live rows, float32 ``[rows, vocab]``; the caller advances the geometry's length."""

    def __init__(
        self,
        direct: DecodeForward,
        model: torch.nn.Module,
        support: ModelSupport,
        additive_dtype: torch.dtype | None,
        capture: bool,
    ):
        self.direct, self.model = direct, model
        self.support, self.additive_dtype = support, additive_dtype
        self.capture = capture
        self._entries: dict[int, _Entry] = {}
        self._slabs: tuple | None = None
        self._params: list[int] = []
        self._pool: Any = None
        self.captured = 0

    def reset(self) -> None:
        """Drop every graph and buffer (the slabs or weights they point to are gone), and their
        memory pool: once its graphs are gone the allocator retires a private pool, and capturing
        into it again fails an internal assert (seen on an H100, torch 2.11, when the slabs grew);
        the next capture opens a new one."""
        self._entries.clear()
        self._slabs = None
        self._pool = None

    def _check_addresses(self, cache: Any) -> None:
        first = cache.layers[0]
        slabs = (first.keys.data_ptr(), tuple(first.keys.shape), len(cache.layers))
        params = [p.data_ptr() for p in self.model.parameters()]
        if slabs != self._slabs or params != self._params:
            self.reset()
            self._slabs, self._params = slabs, params

    def __call__(self, batch: Any) -> torch.Tensor:
        cache, geo, n = batch.cache, batch.geo, batch.n
        self._check_addresses(cache)
        rows = row_bucket(n, int(cache.layers[0].keys.shape[0]))
        entry = self._entries.get(rows)
        if entry is None:
            entry = self._entries[rows] = _Entry(rows, batch.tok.device)
        w = geo.c0 + geo.length
        entry.ids[:n, 0] = batch.tok
        entry.pos[:n, 0] = batch.pos
        entry.lo[:n] = batch.start + geo.c0
        if rows > n:
            entry.ids[n:].zero_()
            entry.pos[n:].zero_()
            entry.lo[n:] = w
        entry.w.fill_(w)
        if not self.capture:
            return self._step(entry, cache)[:n]
        if entry.graph is None:
            self._capture(entry, cache)
        entry.graph.replay()
        return entry.out[:n]

    def _capture(self, entry: _Entry, cache: Any) -> None:
        """Warm up on a side stream (allocations, kernel choices), then record one step. Warm-up
        writes the same KV column the replay writes, from the same inputs."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(entry, cache)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a trainer thread on the same GPU (loop.mode=async) may run kernels meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            entry.out = self._step(entry, cache)
        entry.graph = graph
        self.captured += 1

    def _step(self, entry: _Entry, cache: Any) -> torch.Tensor:
        rows, w = entry.rows, entry.w
        layers = cache.layers
        width = int(layers[0].keys.shape[2])
        cols = torch.arange(width, device=w.device)
        base = (cols >= entry.lo[:, None]) & (cols <= w)
        masks = self._masks(base, cols, w)

        def kv(idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = layers[idx].keys[:rows], layers[idx].values[:rows]
            keys.index_copy_(2, w, k)
            values.index_copy_(2, w, v)
            return keys, values

        return self.direct.run(entry.ids, masks, entry.pos, kv)

    def _masks(
        self, base: torch.Tensor, cols: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Per layer key, the [rows, 1, 1, width] mask: `base` and, for a sliding layer, the
        window behind column `w` (HF's ``q - window < k``)."""
        out: dict[str, torch.Tensor] = {}
        by_window: dict[int | None, torch.Tensor] = {}
        for key, window in self.support.windows.items():
            if window not in by_window:
                m = base if window is None else base & ((w - cols) < window)
                m = m[:, None, None, :]
                if self.additive_dtype is not None:
                    m = additive(m, self.additive_dtype)
                by_window[window] = m
            out[key] = by_window[window]
        return out if self.support.per_layer_type else out[""]
