"""The data-parallel hooks of `weir.train.actor.Actor`: what one process does where FSDP2 ranks
(`weir.train.sharded_actor.ShardedActor`, which overrides them) coordinate: the reference and a
distillation teacher, precision and layout, the micro-batches a process runs, padding passes,
combining rows and metrics across ranks."""

from __future__ import annotations

import contextlib
import copy

import torch

from weir.train.compute_copy import ComputeCopy, cast_parameters
from weir.train.layout_cost import LayoutChoice, layout_choice
from weir.train.packing import Layout, exact_layouts, micro_batches
from weir.train.precision import Precision, model_precision


class ProcessHooks:
    """One process trains everything: the hooks' single-process forms (a mixin of `Actor`)."""

    def _precision(self, model: torch.nn.Module) -> Precision:
        """Device and dtypes of one process (`weir.train.precision.model_precision`)."""
        return model_precision(self.tcfg, model)

    def _compute_copy(self, model: torch.nn.Module) -> ComputeCopy | None:
        """The policy's compute-dtype copy with `train.mixed_precision: compute_copy` (None under
        autocast, without mixed precision, and on FSDP2 ranks, whose shards FSDP2 casts)."""
        if not (self.precision.mixed and self.precision.copy):
            return None
        return ComputeCopy(model, self.precision.compute_dtype)

    def _computing(self, model: object) -> contextlib.AbstractContextManager:
        """The context a forward (and its backward) of `model` runs in: the policy's compute copy
        active (the policy, or a view of it such as LoRA's adapters-off reference); nothing more
        for a frozen model already held in the compute dtype (`_frozen`); else autocast (a no-op
        without mixed precision)."""
        copy_ = getattr(self, "_copy", None)
        if copy_ is None:
            return self.precision.autocast()
        if copy_.covers(model):
            return copy_.active()
        first = next(iter(model.parameters()), None)  # type: ignore[attr-defined]
        if first is not None and first.dtype == self.precision.compute_dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.compute_dtype)

    def _frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model (the reference, a teacher) as the policy computes: with a compute copy,
        its parameters cast to the compute dtype once (what FSDP2's cast of its shards gives, at
        half the memory of float32); else as it is."""
        if getattr(self, "_copy", None) is None:
            return model
        return cast_parameters(model, self.precision.compute_dtype)

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
        with self._computing(self.model):
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
        fusion = getattr(self, "fusion", None)
        compiled = fusion is not None and fusion.route == "compile"
        return layout_choice(
            self.model, candidates, self.device, compute, self.prefix_one_pass, compiled
        )

    def _reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference policy for KL: a copy of the initial model."""
        return self._frozen(copy.deepcopy(model).eval().requires_grad_(False))

    def _load_teacher(self, path: str) -> torch.nn.Module:
        """A distillation teacher from a model directory, frozen, in the policy's device and dtype."""
        from weir.train.model import load_model

        teacher, _ = load_model(path, self.precision.param_dtype, self.device)
        return self._frozen(teacher.eval().requires_grad_(False))

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
