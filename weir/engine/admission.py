"""Admission: prefilling new requests into the running batch, and retiring finished rows.

Part of `weir.engine.torch_engine.TorchEngine` (a mixin: the methods use the engine's state). New
requests that continue a kept conversation (`weir.engine.prefix_cache`) are prefilled over what is
new only; the others over their whole prompts, each prompt once for its n samples and a prefix the
prompts admitted together share (a prompt's episodes, a system message) once (`_shared_past`,
`weir.engine.shared_prefix`). The first token of
every sample is drawn from the prompt's logits (`weir.engine.sampler`), and the rows join the running
batch (`weir.engine.slabs`). After a weight update the running rows' KV is recomputed under the new
weights (`_recompute_kv`). Finished rows resolve their requests' futures and may leave their KV for
the conversation's next turn (`_keep_prefixes`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from weir.data.vision import VisionInputs
from weir.engine.base import Completion
from weir.engine.prefix_cache import PrefixEntry, fill_past
from weir.engine.requests import Request, expand_versions, set_exception
from weir.engine.sampler import sample
from weir.engine.shared_prefix import plan as plan_shared
from weir.engine.slabs import I_KEY, I_MAXNEW, Geometry, Rows, SlabCache
from weir.engine.streams import sample_key

__all__ = ["Admission"]


class Prefilled(NamedTuple):
    """What `Admission._prefill_forward` returns."""

    logits: torch.Tensor  # the last position's, float32 [rows, vocab]
    start: torch.Tensor  # each sequence's first real column
    deltas: list[int]  # each sequence's position offset (a vision-language model's rope delta)
    computed: int  # tokens the forward computed, padding aside (after `past`: the last q columns)
    routes: list[torch.Tensor] | None = None  # routing recorded: each sequence's [len, layers, k]


class Admission:
    """The admission and retirement half of `TorchEngine` (see the module docstring)."""

    def _admit(self, reqs: list[Request]) -> None:
        """Prefill and join `reqs`: those that continue a cached conversation (`_take_prefixes`) in
        one forward over what is new, the others over their whole prompts (in two forwards when
        they share a prefix worth computing once, `_shared_past`)."""
        self._stats["admitted"] += len(reqs)
        past = self._take_prefixes(reqs)
        if not past:
            self._admit_group(reqs, None)
            return
        misses = [r for r in reqs if r not in past]
        if misses:
            self._admit_group(misses, None)
        hits = [r for r in reqs if r in past]
        self._admit_group(hits, [past[r] for r in hits])

    def _take_prefixes(self, reqs: list[Request]) -> dict[Request, PrefixEntry]:
        pc = self._prefix
        if pc is None or not len(pc):
            return {}
        found = {}
        # any request may continue a kept conversation; only keep_kv ones keep theirs
        for r in reqs:
            entry = pc.take(r.prompt, self.version)
            if entry is not None:
                found[r] = entry
        return found

    def _admit_group(self, reqs: list[Request], past: list[PrefixEntry] | None) -> None:
        try:
            staged = self._prefill(reqs, past)
        except Exception as exc:
            if len(reqs) == 1:
                set_exception(reqs[0].future, exc)
                return
            # Isolate the faulty request(s): prefill one by one.
            for i, req in enumerate(reqs):
                self._admit_group([req], None if past is None else [past[i]])
            return
        if staged is not None:
            try:
                self._batch.join(*staged)
            except Exception as exc:  # the running batch may be inconsistent: fail it too
                for req in reqs:
                    set_exception(req.future, exc)
                raise

    def _prefill_forward(
        self,
        seqs: list[list[int]],
        cache: SlabCache,
        width: int | None = None,
        visions: list[VisionInputs | None] | None = None,
        past: list[PrefixEntry] | None = None,
    ) -> Prefilled:
        """One forward over `seqs` right-aligned in `width` columns (default: the longest), filling
        `cache`. Returns the last position's logits, each sequence's first real column, its
        position offset (a vision-language model's rope delta, `weir.data.vision_model`; else 0)
        and the tokens computed.

        With `past` (one cached prefix per sequence) only the last ``q = max(len(seq) - len(prefix))``
        columns are computed: the columns before them are copied from the prefixes, which cover them
        since every prefix is at least ``len(seq) - q`` long (`fill_past`). Without, ``q = width``.
        A vision-language model never has `past` (its prompts' KV holds the image, and its rope
        positions are computed over the whole prompt)."""
        dev = self._device
        lens = [len(x) for x in seqs]
        width = width or max(lens)
        q = width if past is None else max(n - e.length for n, e in zip(lens, past, strict=True))
        pad = self.pad_token_id
        ids = torch.tensor([[pad] * max(0, q - len(x)) + x[max(0, len(x) - q) :] for x in seqs])
        ids = ids.to(dev)
        start = torch.tensor([width - n for n in lens], device=dev)
        if past is not None:
            fill_past(cache, past, lens, width, q)
        col = self._col[:width]
        qcol = col[width - q :]
        # Causal, not attending to left padding; a padding query attends to itself so that no row of
        # the mask is empty (keeps the padding positions finite).
        mask = (col[None, None, :] <= qcol[None, :, None]) & (
            col[None, None, :] >= start[:, None, None]
        )
        mask |= col[None, None, :] == qcol[None, :, None]
        pos = (qcol[None, :] - start[:, None]).clamp_(min=0)
        deltas, pixels = [0] * len(seqs), {}
        if self._vision is not None:
            assert past is None, "no prefix reuse with pixel inputs"
            visions = visions or [None] * len(seqs)
            pixels, deltas = self._vision.padded_inputs(seqs, visions, width, self._dtype)
            pos = pixels.pop("position_ids")
        logits = self._forward(ids, mask[:, None], pos, cache, **pixels)
        return Prefilled(
            logits, start, deltas, sum(min(n, q) for n in lens), self._prefill_routes(lens, q, past)
        )

    def _prefill_routes(
        self, lens: list[int], q: int, past: list[PrefixEntry] | None
    ) -> list[torch.Tensor] | None:
        """Routing recorded: each sequence's experts, those of its cached prefix (`past`) followed by
        those of the columns the forward computed (`self._last_routes`, right-aligned)."""
        if self._routing is None:
            return None
        block = self._last_routes
        out = []
        for i, n in enumerate(lens):
            mine = block[i, q - min(n, q) :]
            if past is not None and n > q:
                mine = torch.cat([past[i].routes[: n - q], mine])
            out.append(mine)
        return out

    def _recompute_kv(self) -> None:
        """Rebuild the running rows' KV cache under the current weights (after a weight update), so
        that the tokens sampled from now on are exactly those of the new policy given the context.

        Prefixes the rows share (a prompt's n samples; a system message every prompt opens with)
        are computed once when that saves enough (`_shared_past`)."""
        b = self._batch
        ngen = b.ngen.tolist()
        toks = b.out_tok_v.tolist()
        # The cache holds prompt + generated[:-1]; the last generated token is the next input.
        seqs = [b.reqs[r].prompt + toks[r][: ngen[r] - 1] for r in range(b.n)]
        visions = [b.reqs[r].vision for r in range(b.n)]
        width = max(len(x) for x in seqs)
        cols = width + b.remaining() + 1
        past, computed = self._shared_past(seqs, cols)
        chunk = max(1, self.max_prefill_tokens // width)
        routes: list[torch.Tensor] = []
        if chunk >= b.n:
            cache = SlabCache(self._num_layers, Geometry(b.n), cols)
            done = self._prefill_forward(seqs, cache, visions=visions, past=past)
            start, computed = done.start, computed + done.computed
            routes = done.routes or []
        else:  # several forwards, each padded to the common width, copied into one cache
            cache, starts = None, []
            for lo in range(0, b.n, chunk):
                hi = min(lo + chunk, b.n)
                part = SlabCache(self._num_layers, Geometry(hi - lo), width)
                done = self._prefill_forward(
                    seqs[lo:hi], part, width, visions[lo:hi], None if past is None else past[lo:hi]
                )
                computed += done.computed
                routes += done.routes or []
                if cache is None:
                    cache = SlabCache(self._num_layers, Geometry(b.n, 0, width), cols)
                    for layer, src in zip(cache.layers, part.layers, strict=True):
                        layer.lazy_initialization(
                            src.keys.new_empty(b.n, *src.keys.shape[1:]),
                            src.values.new_empty(b.n, *src.values.shape[1:]),
                        )
                for layer, src in zip(cache.layers, part.layers, strict=True):
                    layer.keys[lo:hi, :, :width].copy_(src.keys[:, :, :width])
                    layer.values[lo:hi, :, :width].copy_(src.values[:, :, :width])
                starts.append(done.start)
            start = torch.cat(starts)
        b.cache, b.geo = cache, cache.geo
        b.start.copy_(start)
        if routes:  # the rebuilt KV's routing replaces what the old weights picked
            b.routes[: b.n] = [[r] for r in routes]
        self._stats["prefill_tokens"] += computed
        self._stats["recomputed_tokens"] += computed
        self._stats["shared_prefix_tokens"] += max(0, sum(len(x) for x in seqs) - computed)

    def _shared_past(
        self, seqs: list[list[int]], cols: int
    ) -> tuple[list[PrefixEntry] | None, int]:
        """The KV of the prefixes `seqs` share (`weir.engine.shared_prefix.plan`), computed once
        each, as one entry per sequence for `_prefill_forward` (an empty one where a sequence shares
        nothing), and the tokens that took. None (and 0) when sharing does not pay, is off
        (``share_prefixes=False``), the model is a vision-language one (a prompt's KV holds its
        image), or the prefixes' cache would not fit the KV budget beside the `cols`-wide cache
        the caller is about to fill."""
        if not self._share_prefixes or self._vision is not None:
            return None, 0
        shared = plan_shared(seqs)
        if shared is None:
            return None, 0
        wp = max(shared.lengths)
        groups = len(shared.lengths)
        kv = self._kv
        need = (groups * wp + len(seqs) * cols) * kv.cell
        if groups * wp > self.max_prefill_tokens or (
            kv.budget is not None and kv.meter.live + need > kv.budget
        ):
            return None, 0
        prefixes = [seqs[i][:n] for i, n in zip(shared.first, shared.lengths, strict=True)]
        pcache = SlabCache(self._num_layers, Geometry(groups), wp)
        done = self._prefill_forward(prefixes, pcache)
        computed = done.computed
        entries = [
            PrefixEntry(
                tuple(p),
                [layer.keys[g, :, wp - len(p) :] for layer in pcache.layers],
                [layer.values[g, :, wp - len(p) :] for layer in pcache.layers],
                self.version,
                0,
                routes=None if done.routes is None else done.routes[g],
            )
            for g, p in enumerate(prefixes)
        ]
        none = PrefixEntry(
            (),
            [layer.keys[0, :, :0] for layer in pcache.layers],
            [layer.values[0, :, :0] for layer in pcache.layers],
            self.version,
            0,
            routes=None if done.routes is None else done.routes[0][:0],
        )
        return [entries[g] if g >= 0 else none for g in shared.group], computed

    def _prefill(
        self, reqs: list[Request], past: list[PrefixEntry] | None = None
    ) -> tuple[Rows, SlabCache, torch.Tensor] | None:
        """Prefill the prompts of `reqs` (each once; with `past`, only what follows their cached
        prefixes), sample every sample's first token and retire the samples that already finished.
        Returns the other rows, the prompts' cache and, for each row, its prompt's row in that cache
        (None when every sample finished)."""
        dev = self._device
        lens = [len(r.prompt) for r in reqs]
        width = max(lens)
        prompts, visions = [r.prompt for r in reqs], [r.vision for r in reqs]
        shared, computed = None, 0
        if past is None:  # prompts that open alike (a prompt's episodes; a system message)
            shared, computed = self._shared_past(prompts, width)
        before = past if shared is None else shared
        cache = SlabCache(self._num_layers, Geometry(len(reqs)), width)
        logits, _, deltas, done, prompt_routes = self._prefill_forward(
            prompts, cache, visions=visions, past=before
        )
        computed += done
        if past is not None:
            self._prefix.stats["reused_tokens"] += sum(lens) - computed
        elif shared is not None:
            self._stats["shared_prefix_tokens"] += max(0, sum(lens) - computed)
        self._stats["prefill_tokens"] += computed

        # One row per sample: a prompt's cache and logits are shared by its n samples.
        ns = [r.params.n for r in reqs]
        owner = torch.repeat_interleave(
            torch.arange(len(reqs), device=dev), torch.tensor(ns, device=dev)
        )
        row_reqs = [r for r, n in zip(reqs, ns, strict=True) for _ in range(n)]
        sample_idx = [i for n in ns for i in range(n)]
        ints_rows, float_rows, stop_rows = [], [], []
        for r, delta in zip(reqs, deltas, strict=True):
            p = r.params
            topk = p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size
            r.filtered = not r.greedy and (topk < self.vocab_size or p.top_p < 1.0)
            maxnew = min(p.max_new_tokens, self.max_seq_len - len(r.prompt))
            pos = len(r.prompt) + delta  # the first generated token's position
            row = [0, pos, width - len(r.prompt), 0, maxnew, topk, 0, int(r.filtered)]
            frow = [1.0 if r.greedy else 1.0 / p.temperature, p.top_p]
            stops = self.eos_token_ids + self._placeholders + [int(t) for t in p.stop_token_ids]
            for i in range(p.n):
                row[I_KEY] = sample_key(r.seed, i)
                ints_rows.append(list(row))
                float_rows.append(frow)
                stop_rows.append(stops)
        width_s = max(len(s) for s in stop_rows)
        stop_rows = [s + [-1] * (width_s - len(s)) for s in stop_rows]
        cap = max(row[I_MAXNEW] for row in ints_rows)
        nrows = len(row_reqs)
        inc = Rows(
            torch.tensor(ints_rows, dtype=torch.long, device=dev),
            torch.tensor(float_rows, dtype=torch.float32, device=dev),
            torch.tensor(stop_rows, dtype=torch.long, device=dev),
            torch.zeros(nrows, cap, dtype=torch.long, device=dev),
            torch.zeros(nrows, cap, dtype=torch.float32, device=dev),
            torch.zeros(nrows, cap, dtype=torch.float32, device=dev),
            row_reqs,
            sample_idx,
            [[(0, self.version)] for _ in range(nrows)],
            None if prompt_routes is None else [[prompt_routes[o]] for o in owner.tolist()],
        )
        self._sample_and_record(inc, logits.index_select(0, owner))
        if self._prefix is not None:  # samples whose first token is a stop token
            stopped = (inc.stops_v == inc.tok.unsqueeze(1)).any(1).nonzero().squeeze(1).tolist()
            if stopped:
                self._keep_prefixes(inc, stopped, cache, owner.tolist())
        done = self._retire_done(inc)
        if done is not None:
            finished = set(done)
            keep = [i for i in range(nrows) if i not in finished]
            if not keep:
                return None
            k = torch.tensor(keep, device=dev)
            inc = Rows(
                inc.ints.index_select(0, k),
                inc.floats.index_select(0, k),
                inc.stops.index_select(0, k),
                inc.out_tok.index_select(0, k),
                inc.out_lp.index_select(0, k),
                inc.out_lz.index_select(0, k),
                [row_reqs[i] for i in keep],
                [sample_idx[i] for i in keep],
                [inc.vchanges[i] for i in keep],
                [inc.routes[i] for i in keep],
            )
            owner = owner.index_select(0, k)
        return inc, cache, owner

    def _sample_and_record(self, b: Rows, logits: torch.Tensor) -> None:
        """Draw the next token of every live row of `b` from `logits`; record it, its log-prob and
        (top-k/top-p rows) the log of the probability mass the filters kept."""
        ngen = b.ngen
        tok, lp, lz = sample(b, logits, self._vocab_col)
        idx = ngen.unsqueeze(1)
        b.out_tok_v.scatter_(1, idx, tok.unsqueeze(1))
        b.out_lp_v.scatter_(1, idx, lp.unsqueeze(1))
        if lz is not None:
            b.out_lz_v.scatter_(1, idx, lz.unsqueeze(1))
        b.tok.copy_(tok)
        ngen += 1
        self._stats["generated_tokens"] += b.n

    def _retire_done(self, b: Rows) -> list[int] | None:
        """Complete the rows that just finished; return them (sorted), or None when none did."""
        hit = (b.stops_v == b.tok.unsqueeze(1)).any(1)
        done = hit | (b.ngen >= b.maxnew)
        if not bool(done.any()):
            return None
        rows = done.nonzero().squeeze(1).tolist()
        hits = hit.tolist()
        if self._prefix is not None and b is self._batch:
            self._keep_prefixes(b, [r for r in rows if hits[r]], b.cache)
        self._complete(b, rows, ["stop" if hits[i] else "length" for i in rows])
        return rows

    def _keep_prefixes(
        self, b: Rows, rows: list[int], cache: SlabCache, owner: list[int] | None = None
    ) -> None:
        """Copy the KV of the finished ``keep_kv`` rows in `rows` into the prefix cache: prompt +
        tokens generated but the last (sampled, never fed back), all under the current weights.
        Row ``r`` of `b` has its KV in row ``owner[r]`` of `cache` (default: row ``r``), in the
        columns from its start to the end of the used ones."""
        rows = [
            r
            for r in rows
            if b.reqs[r].params.keep_kv
            and (len(b.vchanges[r]) == 1 or self._recompute_kv_on_update)
            and b.vchanges[r][-1][1] == self.version
        ]
        if not rows:
            return
        geo, kv = cache.geo, self._kv
        # Leave room for the scratch slab that moving rows into the finished rows' slots takes.
        scratch = self._batch.slab_bytes() // kv.tensors
        budget = None if kv.budget is None else kv.budget - scratch
        starts, ngens = b.start.tolist(), b.ngen.tolist()
        for r in rows:
            g = ngens[r]
            ids = b.reqs[r].prompt + b.out_tok[r, : g - 1].tolist()
            lo, hi = geo.c0 + starts[r], geo.c0 + geo.length
            if hi - lo != len(ids):  # not the layout this copy assumes: keep nothing
                continue
            row = r if owner is None else owner[r]
            self._prefix.store(
                ids,
                [layer.keys[row, :, lo:hi] for layer in cache.layers],
                [layer.values[row, :, lo:hi] for layer in cache.layers],
                self.version,
                budget,
                routes=torch.cat(b.routes[r]) if self._routing is not None else None,
            )

    def _evict_prefixes_for(self, reqs: list[Request]) -> bool:
        """Evict cached prefixes, oldest first, until `reqs` fit the KV budget; whether they do."""
        pc = self._prefix
        while pc is not None and pc.evict_one():
            if self._kv_fits(reqs):
                return True
        return False

    def _drop_prefixes(self) -> None:
        if self._prefix is not None:
            self._prefix.clear()

    def _complete(self, b: Rows, rows: list[int], reasons: list[str]) -> None:
        idx = torch.tensor(rows, dtype=torch.long, device=self._device)
        ngens = b.ngen.index_select(0, idx).tolist()
        toks = b.out_tok_v.index_select(0, idx).tolist()
        lps = b.out_lp_v.index_select(0, idx).tolist()
        lzs = b.out_lz_v.index_select(0, idx).tolist() if b.n_filtered else None
        for j, r in enumerate(rows):
            g = ngens[j]
            comp = Completion(
                toks[j][:g], lps[j][:g], expand_versions(b.vchanges[r], g), reasons[j]
            )
            if lzs is not None and b.reqs[r].filtered:
                comp.sampled_logprobs = [
                    lp - lz for lp, lz in zip(lps[j][:g], lzs[j][:g], strict=True)
                ]
            if self._routing is not None:
                comp.routed_experts = torch.cat(b.routes[r])
            b.reqs[r].finish_sample(b.sample_idx[r], comp)
