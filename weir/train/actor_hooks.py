"""The data-parallel hooks of `weir.train.actor.Actor`: what one process does where FSDP2 ranks
(`weir.train.sharded_actor.ShardedActor`, which overrides them) coordinate: the reference and a
distillation teacher, precision and layout, the micro-batches a process runs, padding passes,
combining rows and metrics across ranks."""

from __future__ import annotations

import copy

import torch

from weir.train.layout_cost import LayoutChoice, layout_choice
from weir.train.packing import Layout, exact_layouts, micro_batches
from weir.train.precision import Precision


class ProcessHooks:
    """One process trains everything: the hooks' single-process forms (a mixin of `Actor`)."""

    def _precision(self, model: torch.nn.Module) -> Precision:
        """Device and dtypes: the model's own device and parameter dtype, `train.compute_dtype`
        applied with autocast (a no-op when it is not narrower than the parameters)."""
        p = next(model.parameters())
        compute = Precision.from_config(self.tcfg, device=p.device).compute_dtype
        if p.dtype == torch.bfloat16:
            compute = torch.bfloat16
        return Precision(p.device, p.dtype, compute)

    @property
    def layouts(self) -> LayoutChoice:
        """The exact layouts `train.packing` allows (`weir.train.packing.exact_layouts`)."""
        if self._layouts is None:
            self._layouts = self._choose_layouts()
        return self._layouts

    @property
    def layout(self) -> Layout:
        """The micro-batch layout of this step: of `layouts`, the cheapest for its lengths."""
        return self.layouts.current

    def _choose_layouts(self) -> LayoutChoice:
        with self.precision.autocast():
            candidates = exact_layouts(
                self.model,
                self.tcfg.packing,
                shared_prompts=self.shares_prompts,
                compute_dtype=self.precision.compute_dtype,
                with_varlen=True,
            )
        return self._layout_choice(candidates)

    def _layout_choice(self, candidates: list[Layout]) -> LayoutChoice:
        # the dtype attention computes in: autocast's, or FSDP2's cast of the gathered shards
        compute = getattr(self, "_compute", None) or self.precision.compute_dtype
        return layout_choice(self.model, candidates, self.device, compute, self.prefix_one_pass)

    def _reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference policy for KL: a copy of the initial model."""
        return copy.deepcopy(model).eval().requires_grad_(False)

    def _load_teacher(self, path: str) -> torch.nn.Module:
        """A distillation teacher from a model directory, frozen, in the policy's device and dtype."""
        from weir.train.model import load_model

        teacher, _ = load_model(path, self.precision.param_dtype, self.device)
        return teacher.eval().requires_grad_(False)

    @property
    def is_first_rank(self) -> bool:
        """Whether this process is the one that talks to the outside (a served teacher)."""
        return True

    def _from_first_rank(self, rows: torch.Tensor) -> torch.Tensor:
        """Rank 0's `rows` on every rank (one process: `rows` itself)."""
        return rows

    def _micro_batches(
        self,
        indices: list[int],
        seqs: list[list[int]],
        lens: list[int] | None = None,
        layout: Layout | None = None,
    ) -> list[list[int]]:
        """The micro-batches (lists of row indices) this process runs for rows `indices`
        (`lens`: every row's response length, which lets the `prefix` layout group shared prompts).

        An empty list is a padding micro-batch: other ranks have more, and collectives must stay
        in step (see `_idle_pass`).
        """
        mine = [seqs[i] for i in indices]
        return [
            [indices[j] for j in local]
            for local in micro_batches(
                [len(s) for s in mine],
                self.tcfg.micro_batch_tokens,
                layout or self.layout,
                sequences=mine,
                response_lengths=None if lens is None else [lens[i] for i in indices],
            )
        ]

    def _idle_pass(
        self, model: torch.nn.Module, *, backward: bool, layout: Layout | None = None
    ) -> None:
        """Run a padding micro-batch (a no-op for one process)."""

    def _combine_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows computed here, zeros elsewhere -> the rows of every rank."""
        return rows

    def _settle(self) -> None:
        """Put the parameters back in their resting state after forwards without a backward."""

    def _all_finite(self, finite: torch.Tensor) -> torch.Tensor:
        """Whether every rank's micro-batches were finite, as a device flag (so that all ranks
        restart a fused step together, or none does)."""
        return finite

    def _reduce_metrics(
        self, sums: dict[str, float], peaks: dict[str, float]
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Per-process metric sums and maxima -> those of all ranks."""
        return sums, peaks
