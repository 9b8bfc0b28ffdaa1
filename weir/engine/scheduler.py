"""Scheduling: which waiting requests join the running batch, under its row, prefill and KV limits.

Part of `weir.engine.torch_engine.TorchEngine` (a mixin: the methods use the engine's state).
Requests are taken first come, first served while the batch has rows (`max_batch_size`), the
prefill has tokens (`max_prefill_tokens`) and the KV budget (`weir.engine.kv_budget`) has bytes for
their prefill and for every sample's columns to the end; a request that could never fit an empty
engine is refused with `KVBudgetError` instead of waiting forever.
"""

from __future__ import annotations

import gc

from weir.engine.kv_budget import GB, KVBudgetError
from weir.engine.requests import Request, set_exception

__all__ = ["Scheduling"]


class Scheduling:
    """The scheduling part of `TorchEngine` (see the module docstring)."""

    def _drop_cancelled(self) -> None:
        with self._mu:
            cancelled, self._cancelled = self._cancelled, set()
        b = self._batch
        gone = [i for i, r in enumerate(b.reqs) if r in cancelled]
        if gone:
            b.remove(gone)

    def _take_pending(self) -> list[Request]:
        taken: list[Request] = []
        refused: list[tuple[Request, KVBudgetError]] = []
        rows, longest = self._batch.n, 0
        with self._mu:
            while self._pending:
                req = self._pending[0]
                if req.future.cancelled():
                    self._pending.popleft()
                    continue
                n = req.params.n
                longest_if = max(longest, len(req.prompt))
                fits_rows = rows + n <= self.max_batch_size or rows == 0
                fits_tokens = longest_if * (len(taken) + 1) <= self.max_prefill_tokens or not taken
                if not (fits_rows and fits_tokens):
                    break
                if (
                    self._kv.budget is not None
                    and not self._kv_fits([*taken, req])
                    and not self._evict_prefixes_for([*taken, req])
                ):
                    if taken or self._batch.n:
                        break  # wait for rows to finish and give their columns back
                    self._batch.release_cache()  # the idle slabs may be the wrong shape
                    gc.collect()  # an uncollected cycle may still hold KV tensors
                    if not self._kv_fits([req]):
                        self._pending.popleft()
                        refused.append((req, self._kv_refusal(req)))
                        continue
                self._pending.popleft()
                taken.append(req)
                rows += n
                longest = longest_if
        for req, exc in refused:
            set_exception(req.future, exc)
        return taken

    def _max_new(self, req: Request) -> int:
        return min(req.params.max_new_tokens, self.max_seq_len - len(req.prompt))

    def _kv_fits(self, reqs: list[Request]) -> bool:
        """Whether admitting `reqs` now keeps the KV bytes alive within the budget: their prefill
        cache on top of what is alive, then the running slabs (grown if need be) with every sample
        of every request joined."""
        b, kv = self._batch, self._kv
        width = max(len(r.prompt) for r in reqs)
        prefill = len(reqs) * width * kv.cell
        if kv.meter.live + prefill > kv.budget:
            return False
        new_len = max(b.geo.length if b.n else 0, width)
        headroom = max(b.remaining(), max(self._max_new(r) - 1 for r in reqs))
        rows = b.n + sum(r.params.n for r in reqs)
        return b.plan(rows, new_len + headroom, extra=prefill) is not None

    def _kv_refusal(self, req: Request) -> KVBudgetError:
        return self._kv_error(len(req.prompt), req.params.n, self._max_new(req))

    def _kv_error(self, prompt_len: int, n: int, max_new: int) -> KVBudgetError:
        kv = self._kv
        cols = prompt_len + max_new - 1
        need = self.kv_request_bytes(prompt_len, n, max_new)
        return KVBudgetError(
            f"a request with a {prompt_len}-token prompt, n={n} and up to {max_new} new tokens "
            f"needs {need / GB:.3g} GiB of KV cache ({n} rows x {cols} columns x {kv.cell} bytes, "
            f"with its prefill and scratch), more than the engine's KV budget of "
            f"{kv.budget / GB:.3g} GiB; raise engine.kv_budget_gb (or engine.kv_budget_fraction), "
            "or lower n / max_new_tokens"
        )

    def kv_request_bytes(self, prompt_len: int, n: int, max_new_tokens: int) -> int:
        """KV bytes one request needs at its peak on an otherwise empty engine: its prompt's prefill
        row, then ``n`` rows of ``prompt_len + max_new - 1`` columns, plus one slab of scratch."""
        kv = self._kv
        max_new = min(max_new_tokens, self.max_seq_len - prompt_len)
        slabs = n * (prompt_len + max_new - 1) * kv.cell
        return prompt_len * kv.cell + slabs + slabs // kv.tensors

    def check_fits(self, prompt_len: int, n: int, max_new_tokens: int) -> None:
        """Raise `KVBudgetError` when a request of this size could never be admitted (at start-up,
        so that a run whose every request would fail is refused before it begins)."""
        kv = self._kv
        prompt_len = min(prompt_len, self.max_seq_len - 1)
        if (
            kv.budget is not None
            and self.kv_request_bytes(prompt_len, n, max_new_tokens) > kv.budget
        ):
            raise self._kv_error(prompt_len, n, min(max_new_tokens, self.max_seq_len - prompt_len))
