"""Cross-turn KV reuse for the torch engine: the KV of a finished multi-turn request, kept for the
request that continues its conversation.

A multi-turn episode calls the engine once per model turn with the whole conversation so far:
turn t+1's prompt is turn t's prompt + its completion + an observation. Without reuse every turn
prefills the whole context again, so an episode of T turns over a context of L tokens prefills
O(T * L) tokens. With reuse, turn t+1 prefills only what is new (the last token of turn t, which was
sampled but never fed back, and the observation).

Design: a prefix cache keyed by token ids, filled only by requests that ask for it
(``SamplingParams.keep_kv``, set by the multi-turn rollout), rather than an explicit session handle,
because the `Engine` protocol is one ``generate(prompt_ids, params)`` call shared with vLLM and
SGLang (which cache prefixes themselves) and with the router in front of replicas: a caller that
sends the conversation as token ids needs no handle to thread through, and a cache miss (another
replica, an evicted entry) costs a full prefill, never a wrong answer.

- An entry holds, for one finished sample, the ids whose KV is cached (prompt + completion minus
  its last token) and one ``[kv_heads, length, head_dim]`` key and value tensor per layer, copied
  out of the running batch's slabs when the sample finished with a stop token.
- A new request (with or without ``keep_kv``) takes the longest entry that is a proper prefix of its prompt (at least one token
  must be left to compute the next-token logits) and was computed under the current weight version.
  The entry is *consumed*: the continuing request stores a longer one when it finishes, so a live
  episode holds one entry. Samples that finish with the same ids share one entry, counted once per
  sample (GRPO's n samples of a prompt often make the same tool call).
- Entries are evicted least recently stored first: beyond ``max_entries``, when the engine's KV
  budget (`weir.engine.kv_budget`) needs the room for admission, and all at once on a weight update,
  a sleep, an abort or an idle release. Their bytes are tracked by the engine's `KVMeter`, so the
  budget counts them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from weir.engine.kv_budget import KVMeter

__all__ = ["PrefixCache", "PrefixEntry", "fill_past"]


@dataclass
class PrefixEntry:
    """The cached KV of `ids` (per layer: keys and values ``[kv_heads, len(ids), head_dim]``)."""

    ids: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    version: int
    nbytes: int
    refs: int = 1
    routes: torch.Tensor | None = None
    """The experts the routers picked for `ids` (routing recorded, `weir.data.moe_routing`)."""
    """Finished samples that left these same ids (n samples of a prompt often agree on a turn); each
    `take` serves one of them."""

    @property
    def length(self) -> int:
        return len(self.ids)


class PrefixCache:
    """Entries by their ids, least recently stored first; lookups by longest matching prefix."""

    def __init__(self, meter: KVMeter, max_entries: int):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.meter = meter
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self._lengths: dict[int, int] = {}  # entry length -> number of entries of that length
        # reused_tokens: prompt tokens not prefilled thanks to a hit (counted by the engine)
        self.stats = {"stored": 0, "hits": 0, "misses": 0, "reused_tokens": 0, "evicted": 0}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def store(
        self,
        ids: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        version: int,
        budget: int | None,
        routes: torch.Tensor | None = None,
    ) -> bool:
        """Keep copies of `keys` / `values` (views of a slab row) for `ids`, and their recorded
        `routes`. Under a `budget`, older entries make room first; an entry that cannot fit is not
        stored. Returns whether it was."""
        nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))
        if budget is not None:
            while self._entries and self.meter.live + nbytes > budget:
                self._evict_oldest()
            if self.meter.live + nbytes > budget:
                return False
        key = tuple(ids)
        old = self._entries.get(key)
        if old is not None and old.version == version:  # the same KV: count it, copy nothing
            old.refs += 1
            self._entries.move_to_end(key)
            self.stats["stored"] += 1
            return True
        if old is not None:
            self._remove(key)
        while len(self._entries) >= self.max_entries:
            self._evict_oldest()
        entry = PrefixEntry(
            key,
            [self.meter.track(k.clone()) for k in keys],
            [self.meter.track(v.clone()) for v in values],
            version,
            nbytes,
            routes=routes,
        )
        self._entries[key] = entry
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1
        self.stats["stored"] += 1
        return True

    def take(self, prompt: list[int], version: int) -> PrefixEntry | None:
        """Take (one use of) the longest entry of weight `version` whose ids are a proper prefix of
        `prompt`; None (a miss) when there is none."""
        for length in sorted(self._lengths, reverse=True):
            if length >= len(prompt):
                continue
            entry = self._entries.get(tuple(prompt[:length]))
            if entry is not None and entry.version == version:
                entry.refs -= 1
                if not entry.refs:
                    self._remove(entry.ids)
                self.stats["hits"] += 1
                return entry
        self.stats["misses"] += 1
        return None

    def evict_one(self) -> bool:
        """Drop the least recently stored entry; False when there is none."""
        if not self._entries:
            return False
        self._evict_oldest()
        return True

    def clear(self) -> None:
        """Drop every entry (weights changed, or the memory is wanted back)."""
        self.stats["evicted"] += len(self._entries)
        self._entries.clear()
        self._lengths.clear()

    def _evict_oldest(self) -> None:
        key = next(iter(self._entries))
        self._remove(key)
        self.stats["evicted"] += 1

    def _remove(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        n = self._lengths[len(key)] - 1
        if n:
            self._lengths[len(key)] = n
        else:
            del self._lengths[len(key)]


def fill_past(cache: Any, past: list[PrefixEntry], lens: list[int], width: int, q: int) -> None:
    """Prepare an empty prefill `cache` (a `weir.engine.slabs.SlabCache`) for sequences of lengths
    `lens` right-aligned in `width` columns, of which only the last `q` will be computed: write the
    first ``len - q`` tokens' KV of each row from its entry into the columns ``[width - len,
    width - q)`` and mark the first ``width - q`` columns used. Every entry must hold at least
    ``len - q`` tokens (true for ``q = max(len - entry.length)``)."""
    p = width - q
    rows = len(past)
    for li, layer in enumerate(cache.layers):
        k0, v0 = past[0].keys[li], past[0].values[li]
        layer.lazy_initialization(
            k0.new_empty(rows, k0.shape[0], 1, k0.shape[-1]),
            v0.new_empty(rows, v0.shape[0], 1, v0.shape[-1]),
        )
        for row, (n, entry) in enumerate(zip(lens, past, strict=True)):
            m = n - q
            if m > 0:
                layer.keys[row, :, width - n : p].copy_(entry.keys[li][:, :m])
                layer.values[row, :, width - n : p].copy_(entry.values[li][:, :m])
    cache.geo.length = p
