"""The torch engine's running batch and its KV cache: preallocated slabs whose rows are right-aligned
(see `weir.engine.torch_engine`'s module docstring), per-row sampling state, and the moves that admit
rows, retire them and grow the slabs within the KV budget.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from weir.engine.kv_budget import KVMeter, KVState, SlabPlan, current_meter, plan_slabs
from weir.engine.requests import Request


class Geometry:
    """Which part of the slabs is in use: rows ``[0, rows)``, columns ``[c0, c0 + length)``."""

    __slots__ = ("rows", "c0", "length")

    def __init__(self, rows: int, c0: int = 0, length: int = 0):
        self.rows, self.c0, self.length = rows, c0, length


class SlabLayer(CacheLayerMixin):
    """One layer's keys/values in slabs ``[row_capacity, kv_heads, col_capacity, head_dim]``.

    ``update`` writes the new columns after the used ones in place and returns views of the used
    part; the shared geometry's ``length`` is advanced by the engine once per forward pass.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, geo: Geometry, capacity: int):
        super().__init__()
        self.geo = geo
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, _ = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(b, h, self.capacity, key_states.shape[-1])
        self.values = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1])
        meter = current_meter()
        if meter is not None:
            meter.track(self.keys)
            meter.track(self.values)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        g = self.geo
        n, c0 = g.rows, g.c0
        start = c0 + g.length
        end = start + key_states.shape[-2]
        self.keys[:n, :, start:end].copy_(key_states)
        self.values[:n, :, start:end].copy_(value_states)
        return self.keys[:n, :, c0:end], self.values[:n, :, c0:end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.geo.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.geo.length

    def get_max_length(self) -> int:
        return -1


class SlabCache(Cache):
    def __init__(self, num_layers: int, geo: Geometry, capacity: int):
        super().__init__(layers=[SlabLayer(geo, capacity) for _ in range(num_layers)])
        self.geo = geo

    def used(self, layer: SlabLayer) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.geo
        return (
            layer.keys[: g.rows, :, g.c0 : g.c0 + g.length],
            layer.values[: g.rows, :, g.c0 : g.c0 + g.length],
        )


# Column layout of the per-row integer state.
I_TOK, I_POS, I_START, I_NGEN, I_MAXNEW, I_TOPK, I_KEY, I_FILT = range(8)
# Column layout of the per-row float state.
F_INVT, F_TOPP = range(2)


class Rows:
    """Per-row state: tensors for the hot path (rows ``[0, n)`` live; the tensors may have spare rows
    and columns), Python lists for bookkeeping.

    ints[:, I_TOK]    last sampled token (the next step's input)   ints[:, I_POS]   its position id
    ints[:, I_START]  first real cache column of the row            ints[:, I_NGEN]  tokens generated
    ints[:, I_MAXNEW] generation limit                              ints[:, I_TOPK]  top-k (vocab = off)
    ints[:, I_KEY]    random stream key                             ints[:, I_FILT]  1 if top-k/p apply
    floats[:, F_INVT] 1 / temperature (1 when greedy)              floats[:, F_TOPP] top-p
    stops  [rows, S] stop ids (eos included), padded with -1
    out_tok / out_lp [rows, C]  generated tokens and their log-probs (full vocabulary)
    out_lz [rows, C]  log of the probability mass top-k/top-p kept at each step (0 when unfiltered):
                      the token's log-prob under the distribution it was drawn from is out_lp - out_lz
    """

    def __init__(
        self, ints, floats, stops, out_tok, out_lp, out_lz, reqs, sample_idx, vchanges, routes=None
    ):
        self.ints, self.floats, self.stops = ints, floats, stops
        self.out_tok, self.out_lp, self.out_lz = out_tok, out_lp, out_lz
        self.reqs: list[Request] = reqs
        self.sample_idx: list[int] = sample_idx
        self.vchanges: list[list[tuple[int, int]]] = vchanges
        # recorded routing (`weir.data.moe_routing`) per row: [tokens, layers, k] pieces, in order
        self.routes: list[list[torch.Tensor]] = routes if routes is not None else [[] for _ in reqs]
        self.n = len(reqs)
        self.n_greedy = sum(r.greedy for r in reqs)
        self.n_filtered = sum(r.filtered for r in reqs)
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the views of the live rows (after rows joined or left)."""
        n = self.n
        ints = self.ints[:n]
        self.tok, self.pos, self.start = ints[:, I_TOK], ints[:, I_POS], ints[:, I_START]
        self.ngen, self.maxnew, self.key = ints[:, I_NGEN], ints[:, I_MAXNEW], ints[:, I_KEY]
        self.top_k = ints[:, I_TOPK]
        self.inv_t, self.top_p = self.floats[:n, F_INVT], self.floats[:n, F_TOPP]
        self.stops_v, self.out_tok_v, self.out_lp_v, self.out_lz_v = (
            self.stops[:n],
            self.out_tok[:n],
            self.out_lp[:n],
            self.out_lz[:n],
        )
        self.all_greedy = n > 0 and self.n_greedy == n
        if self.n_greedy and not self.all_greedy:
            self.greedy_idx = torch.tensor(
                [i for i, r in enumerate(self.reqs) if r.greedy], device=ints.device
            )
        else:
            self.greedy_idx = None
        self.filt_idx = ints[:, I_FILT].nonzero().squeeze(1) if self.n_filtered else None

    def remaining(self) -> int:
        """The most tokens any live row may still generate."""
        return int((self.maxnew - self.ngen).max()) if self.n else 0


class RunningBatch(Rows):
    """The running batch: rows plus their KV slabs (geometry shared with the cache layers)."""

    def __init__(
        self, num_layers: int, device: torch.device, max_rows: int, kv: KVState | None = None
    ):
        self.num_layers = num_layers
        self.device = device
        self.max_rows = max_rows
        self.kv = kv or KVState(0, 2 * num_layers, None, 1 << 62, KVMeter())
        z = torch.zeros(0, 8, dtype=torch.long, device=device)
        super().__init__(
            z,
            torch.zeros(0, 2, device=device),
            torch.zeros(0, 1, dtype=torch.long, device=device),
            torch.zeros(0, 1, dtype=torch.long, device=device),
            torch.zeros(0, 1, device=device),
            torch.zeros(0, 1, device=device),
            [],
            [],
            [],
        )
        self.geo = Geometry(0)
        self.cache: SlabCache | None = None

    # -- joining ------------------------------------------------------------------------------------

    def join(self, inc: Rows, pcache: SlabCache, owner: torch.Tensor) -> None:
        """Append the rows of `inc`, whose KV is row ``owner[i]`` of the prefill cache `pcache`."""
        b, m = self.n, inc.n
        geo = self.geo
        lp, length = pcache.geo.length, geo.length
        new_len = max(length, lp)
        headroom = max(self.remaining(), inc.remaining())
        c0 = geo.c0 - (new_len - length) if b else 0
        rows_cap, cols_cap = self.capacity()
        if self.cache is None or b + m > rows_cap or new_len + headroom > cols_cap:
            self._realloc_cache(b + m, new_len, headroom, pcache)
            geo = self.geo
        elif c0 < 0 or c0 + new_len + headroom > cols_cap:
            self._move_live(new_len, headroom)  # the capacity suffices, not on this side
        elif new_len > length or not b:
            # Extend the used columns to the left (stale columns there are finite and masked out).
            if b:
                self.start += new_len - length
            geo.c0, geo.length = c0, new_len
        # Newcomers' KV, right-aligned.
        c0 = geo.c0
        for layer, player in zip(self.cache.layers, pcache.layers, strict=True):
            for name in ("keys", "values"):
                dst = getattr(layer, name)[b : b + m, :, c0 + new_len - lp : c0 + new_len]
                src = getattr(player, name)[:, :, :lp]
                torch.index_select(src, 0, owner, out=dst)
        self._append_rows(inc, new_len - lp)
        geo.rows = self.n

    def _realloc_cache(self, rows: int, new_len: int, headroom: int, like: SlabCache) -> None:
        """New slabs with room for `rows` rows and `new_len + headroom` columns; live rows are moved
        right-aligned to column ``c0 + new_len``, with ``c0 = left_slack(...)``."""
        geo = self.geo
        b, length = self.n, geo.length
        plan = self.plan(rows, new_len + headroom)
        if plan is None or not plan.realloc:  # over budget (only the decode-time safety net gets
            # here: admission checked the plan) or large enough: the exact need, in new slabs
            plan = SlabPlan(max(rows, self.capacity()[0]), new_len + headroom, 0, True)
        rows_cap, cols_cap = plan.rows, plan.cols
        left = left_slack(cols_cap, new_len + headroom)
        old = self.cache
        if not b:
            self.cache = old = None  # nothing to copy: free the old slabs before allocating
        new_geo = Geometry(b, left, new_len)
        new = SlabCache(self.num_layers, new_geo, cols_cap)
        meter = self.kv.meter
        for i, layer in enumerate(new.layers):
            ref = like.layers[i]
            for name in ("keys", "values"):
                t = getattr(ref, name)
                buf = meter.track(t.new_zeros(rows_cap, t.shape[1], cols_cap, t.shape[3]))
                if b:
                    src = getattr(old.layers[i], name)
                    buf[:b, :, left + new_len - length : left + new_len].copy_(
                        src[:b, :, geo.c0 : geo.c0 + length]
                    )
                    setattr(old.layers[i], name, None)  # free each old slab once copied
                    del src
                setattr(layer, name, buf)
            layer.dtype, layer.device, layer.is_initialized = ref.dtype, ref.device, True
        self.kv.reallocs += 1
        self.kv.copied_bytes += b * length * self.kv.cell
        real = sum(
            t.numel() * t.element_size() for layer in new.layers for t in (layer.keys, layer.values)
        )
        if self.kv.cell and real != rows_cap * cols_cap * self.kv.cell:
            raise NotImplementedError(
                f"the model's KV tensors take {real} bytes for {rows_cap} x {cols_cap} cells, not the "
                f"{self.kv.cell} bytes per cell measured at start; the KV budget cannot be kept"
            )
        if b and new_len > length:
            self.start += new_len - length
        self.cache, self.geo = new, new_geo

    # -- capacity -----------------------------------------------------------------------------------

    def capacity(self) -> tuple[int, int]:
        """Rows and columns of the current slabs (0, 0 when there are none)."""
        if self.cache is None:
            return 0, 0
        keys = self.cache.layers[0].keys
        return int(keys.shape[0]), int(keys.shape[2])

    def slab_bytes(self) -> int:
        rows, cols = self.capacity()
        return rows * cols * self.kv.cell

    def plan(self, need_rows: int, need_cols: int, extra: int = 0) -> SlabPlan | None:
        """Slabs for `need_rows` rows x `need_cols` columns (`plan_slabs`), with `extra` bytes more
        alive meanwhile (a prefill not yet run)."""
        kv = self.kv
        rows_cap, cols_cap = self.capacity()
        return plan_slabs(
            need_rows=need_rows,
            need_cols=need_cols,
            cap_rows=rows_cap,
            cap_cols=cols_cap,
            max_rows=self.max_rows,
            max_cols=kv.max_cols,
            live=kv.meter.live + extra,
            old_bytes=self.slab_bytes(),
            cell=kv.cell,
            tensors=kv.tensors,
            budget=kv.budget,
            copy_old=self.n > 0,
        )

    def _move_live(self, new_len: int, headroom: int) -> None:
        """Move the live columns within the slabs so that they end at column ``c0 + new_len``, with
        ``c0 = left_slack(...)``, one slab at a time through a scratch copy of its live part."""
        geo = self.geo
        b, c0, length = self.n, geo.c0, geo.length
        left = left_slack(self.capacity()[1], new_len + headroom)
        dst0 = left + new_len - length
        meter = self.kv.meter
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                src = t[:b, :, c0 : c0 + length]
                if abs(dst0 - c0) < length:  # overlapping ranges: go through scratch
                    src = meter.track(src.clone())
                t[:b, :, dst0 : dst0 + length].copy_(src)
                del src
        if b and new_len > length:
            self.start += new_len - length
        geo.c0, geo.length = left, new_len
        self.kv.moves += 1
        self.kv.copied_bytes += b * length * self.kv.cell

    def release_cache(self) -> None:
        """Drop the slabs (their memory is freed once nothing else references them). Rows still
        live need their KV rebuilt (the engine's recompute) before the next decode step."""
        if self.cache is not None:
            self.kv.releases += 1
        self.cache = None
        self.geo = Geometry(self.n)

    def _append_rows(self, inc: Rows, start_shift: int) -> None:
        b, m = self.n, inc.n
        need = b + m
        self.ints = ensure_capacity(self.ints, need, self.ints.shape[1], 0)
        self.floats = ensure_capacity(self.floats, need, self.floats.shape[1], 0.0)
        self.stops = ensure_capacity(self.stops, need, inc.stops.shape[1], -1)
        self.out_tok = ensure_capacity(self.out_tok, need, inc.out_tok.shape[1], 0)
        self.out_lp = ensure_capacity(self.out_lp, need, inc.out_lp.shape[1], 0.0)
        self.out_lz = ensure_capacity(self.out_lz, need, inc.out_lz.shape[1], 0.0)
        self.ints[b:need] = inc.ints[:m]
        if start_shift:
            self.ints[b:need, I_START] += start_shift
        self.floats[b:need] = inc.floats[:m]
        self.stops[b:need].fill_(-1)
        self.stops[b:need, : inc.stops.shape[1]] = inc.stops[:m]
        self.out_tok[b:need, : inc.out_tok.shape[1]] = inc.out_tok[:m]
        self.out_lp[b:need, : inc.out_lp.shape[1]] = inc.out_lp[:m]
        self.out_lz[b:need, : inc.out_lz.shape[1]] = inc.out_lz[:m]
        self.reqs += inc.reqs[:m]
        self.sample_idx += inc.sample_idx[:m]
        self.vchanges += inc.vchanges[:m]
        self.routes += inc.routes[:m]
        self.n = need
        self.n_greedy += inc.n_greedy
        self.n_filtered += inc.n_filtered
        self.refresh()

    # -- leaving ------------------------------------------------------------------------------------

    def remove(self, rows: list[int]) -> None:
        """Drop `rows` (sorted, distinct): the last live rows move into their slots, then the cache
        columns that are padding for every remaining row are trimmed."""
        b = self.n
        keep_n = b - len(rows)
        gone = set(rows)
        holes = [r for r in rows if r < keep_n]
        movers = [r for r in range(keep_n, b) if r not in gone]
        for r in rows:
            req = self.reqs[r]
            self.n_greedy -= req.greedy
            self.n_filtered -= req.filtered
        if holes:
            h = torch.tensor(holes, device=self.device)
            mv = torch.tensor(movers, device=self.device)
            for t in (self.ints, self.floats, self.stops, self.out_tok, self.out_lp, self.out_lz):
                t.index_copy_(0, h, t.index_select(0, mv))
            for layer in self.cache.layers if self.cache is not None else ():
                for t in self.cache.used(layer):
                    t.index_copy_(0, h, self.kv.meter.track(t.index_select(0, mv)))
            for lst in (self.reqs, self.sample_idx, self.vchanges, self.routes):
                for dst, src in zip(holes, movers, strict=True):
                    lst[dst] = lst[src]
        for lst in (self.reqs, self.sample_idx, self.vchanges, self.routes):
            del lst[keep_n:]
        self.n = keep_n
        self.geo.rows = keep_n
        self.refresh()
        if not keep_n:  # empty: the slabs are reused from column 0 by the next join
            self.geo.c0 = self.geo.length = 0
        else:
            first = int(self.start.min())
            if first:
                self.start -= first
                self.geo.c0 += first
                self.geo.length -= first


def left_slack(cols_cap: int, need: int) -> int:
    """Where the used columns start after a reallocation or a move: half the spare columns.

    Columns are used on both sides: every decode step takes one on the right, and a newcomer whose
    prompt is longer than the used columns extends them on the left. With the spare split evenly,
    neither side runs out at the next such event, so a stream of admissions with growing prompts
    (multi-turn conversations) does not move the whole cache on every admission."""
    return max(0, cols_cap - need) // 2


def ensure_capacity(t: torch.Tensor, rows: int, cols: int, fill: float) -> torch.Tensor:
    """`t` itself when it has room for `rows` x `cols`, else a larger copy (rows doubled)."""
    if rows <= t.shape[0] and cols <= t.shape[1]:
        return t
    new_rows = max(rows, 2 * t.shape[0]) if rows > t.shape[0] else t.shape[0]
    out = t.new_full((new_rows, max(cols, t.shape[1])), fill)
    out[: t.shape[0], : t.shape[1]] = t
    return out
