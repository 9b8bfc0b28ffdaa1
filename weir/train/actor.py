"""The actor: log-probs, advantages and policy-gradient updates on packed micro-batches.

One `train(batch)` call is one RL step: recompute old / reference log-probs if configured,
compute advantages, then `epochs x mini_batches` optimizer steps, each accumulating gradients over
packed micro-batches. Loss aggregation uses the token / sequence counts of the whole mini-batch, so
the gradient does not depend on how it was split into micro-batches.
"""

from __future__ import annotations

import copy
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weir import algo
from weir.telemetry.timeline import span
from weir.train.actor_settings import ActorSettings, check_algo_options
from weir.train.batch import TrainBatch
from weir.train.credit import step_advantages
from weir.train.fuse import apply_fusion
from weir.train.layout_cost import LayoutChoice, layout_choice
from weir.train.memory_plan import planned_train_config
from weir.train.modes import grad_mode, prepare_for_training
from weir.train.optim import make_optimizer, make_schedule
from weir.train.packing import (
    Layout,
    exact_layouts,
    micro_batches,
    prefix_refusal,
    prefix_refused_unprobed,
    response_logprobs,
)
from weir.train.precision import Precision
from weir.train.step_checks import (
    add_loss_metrics,
    drop_nonfinite,
    finite_forward,
    mismatch,
    warn_over_max_len,
)

if TYPE_CHECKING:
    from weir.train.critic import Critic


class Actor:
    """Policy model, optimizer and schedule, plus an optional frozen reference for KL."""

    offload_in_optimizer = True
    """`train.offload_optimizer` is done by the optimizer (OffloadedAdamW); FSDP2 does it itself."""
    shares_prompts = True
    """`train.packing=auto` may pick the `prefix` layout (one forward per distinct prompt)."""
    defers_layout = False
    """`train.packing` is resolved at the first forward rather than at construction (FSDP ranks:
    the exactness probe of `auto` runs forwards, which belong to training, not to loading)."""
    prefix_one_pass = False
    """The `prefix` layout runs a micro-batch's responses in one pass (two model forwards in all)
    instead of passes of similar length (FSDP ranks: every rank must run as many forwards)."""
    fuses_old_logprobs = True
    """A step of one update takes recomputed old log-probs from its own forward (`_fused_old`)."""
    skips_dead_backward = True
    """Rows that cannot move the weights take no backward, and with `train.dead_rows=skip` no
    forward either (`_dead_rows`)."""

    def __init__(self, model: torch.nn.Module, settings: ActorSettings) -> None:
        self.settings = settings
        self.tcfg, self.acfg = settings.train, settings.algo
        self.loss_options = dict(self.acfg.loss_options)
        self.max_len = int(self.loss_options.pop("max_len", settings.max_response_tokens))
        self._warned_max_len = False
        self.precision = self._precision(model)
        self.device = self.precision.device
        # train.memory=plan: checkpointing and the micro-batch budget from the memory model
        self.tcfg = planned_train_config(self.tcfg, model, self.device, self.precision)
        self.model = prepare_for_training(model, checkpointing=self.tcfg.gradient_checkpointing)
        self._layouts: LayoutChoice | None = None
        if not self.defers_layout:
            self._layouts = self._choose_layouts()
        elif self.tcfg.packing == "prefix":  # asked for: what can be refused without a probe is
            refused = prefix_refused_unprobed(self.model)
            if refused is not None:
                raise prefix_refusal(refused)
        self.temperature = settings.temperature
        self.optimizer = make_optimizer(
            model.parameters(),
            lr=self.tcfg.lr,
            betas=self.tcfg.betas,
            weight_decay=self.tcfg.weight_decay,
            offload=self.tcfg.offload_optimizer and self.offload_in_optimizer,
        )
        self.scheduler = make_schedule(
            self.optimizer,
            warmup_steps=self.tcfg.warmup_steps,
            total_steps=settings.total_steps,
            kind=self.tcfg.schedule,
            min_lr_ratio=self.tcfg.min_lr_ratio,
        )
        self.advantage_fn = algo.resolve(
            self.acfg.advantage, algo.ADVANTAGES, kind="algo.advantage"
        )
        self.loss_fn = algo.resolve(
            self.acfg.policy_loss, algo.POLICY_LOSSES, kind="algo.policy_loss"
        )
        kl = self.acfg.kl
        self.ref = self._reference(model) if kl.coef > 0 else None
        if kl.adaptive_target is not None:
            self.kl_ctl = algo.AdaptiveKLController(
                kl.coef, kl.adaptive_target, kl.adaptive_horizon
            )
        else:
            self.kl_ctl = algo.FixedKLController(kl.coef)
        self.fusion = apply_fusion(self.tcfg.fuse, self.model, self.device)
        if self.ref is not None:  # a deep copy: uncompiled, and unfused if made before
            apply_fusion(self.tcfg.fuse, self.ref, self.device, quiet=True)
        self.skipped_updates = 0
        self.skipped_steps = 0
        self.updates = 0
        check_algo_options(
            self.acfg, self.advantage_fn, self.loss_fn, self.max_len, self.loss_options
        )

    # -- data-parallel hooks: one process trains everything; weir.train.sharded_actor overrides them --

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

    def _forward(self, model: torch.nn.Module, seqs, lens, **kwargs):
        """Response log-probs of one micro-batch in the configured layout and compute dtype."""
        with self.precision.autocast():
            return response_logprobs(
                model,
                seqs,
                lens,
                layout=self.layout,
                temperature=self.temperature,
                chunk_size=self.tcfg.logprob_chunk_tokens,
                one_pass=self.prefix_one_pass,
                **kwargs,
            )

    def _reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference policy for KL: a copy of the initial model."""
        return copy.deepcopy(model).eval().requires_grad_(False)

    def _micro_batches(
        self, indices: list[int], seqs: list[list[int]], lens: list[int] | None = None
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
                self.layout,
                sequences=mine,
                response_lengths=None if lens is None else [lens[i] for i in indices],
            )
        ]

    def _idle_pass(self, model: torch.nn.Module, *, backward: bool) -> None:
        """Run a padding micro-batch (a no-op for one process)."""

    def _combine_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows computed here, zeros elsewhere -> the rows of every rank."""
        return rows

    def _settle(self) -> None:
        """Put the parameters back in their resting state after forwards without a backward."""

    def _all_finite(self, finite: bool) -> bool:
        """Whether every rank's micro-batch was finite (so that all ranks restart a fused step
        together, or none does)."""
        return finite

    def _reduce_metrics(
        self, sums: dict[str, float], peaks: dict[str, float]
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Per-process metric sums and maxima -> those of all ranks."""
        return sums, peaks

    @property
    def needs_recompute(self) -> bool:
        return (
            self.acfg.old_logprobs == "recompute"
            or self.acfg.policy_loss == "decoupled_ppo"
            or self.acfg.correction.mode != "none"
        )

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        """(B, T) log-probs of the batch's response tokens under `model`, without gradients, on the
        trainer's device."""
        batch = batch.to(self.device)
        out = torch.zeros_like(batch.response_mask)
        seqs, lens, vis = batch.sequences, batch.response_lengths, batch.visions
        for idx in self._micro_batches(list(range(len(seqs))), seqs, lens):
            if not idx:
                self._idle_pass(model, backward=False)
                continue
            with span("logprobs", cat="train", sequences=len(idx)):
                res = self._forward(
                    model,
                    [seqs[i] for i in idx],
                    [lens[i] for i in idx],
                    pad_to=out.shape[1],
                    visions=[vis[i] for i in idx],
                )
            out[idx] = res.logprobs
        return self._combine_rows(out)

    @property
    def _fused_old(self) -> bool:
        """Whether recomputed old log-probs come from the update's own forward, detached.

        With one update per step (epochs = mini_batches = 1), no reference model and no rollout
        correction, nothing reads the old log-probs before the update's forward, and that forward
        runs the very weights a separate no-grad pass would: pi_old = pi_theta exactly, the ratio is
        1, and the separate pass is a whole forward of redundant compute (as TRL's
        ``num_iterations=1`` also skips it).
        """
        return (
            self.fuses_old_logprobs
            and self.acfg.old_logprobs == "recompute"
            and self.acfg.policy_loss != "decoupled_ppo"
            and self.acfg.correction.mode == "none"
            and self.ref is None
            and self.tcfg.epochs == 1
            and self.tcfg.mini_batches == 1
        )

    def train(self, batch: TrainBatch, critic: Critic | None = None) -> dict[str, float]:
        """One RL step of updates on `batch`; returns metrics (loss, clip fraction, KL, grad norm...).

        With a `critic` (algo.advantage=gae): its values of the batch feed GAE, it is trained
        towards GAE's returns, and during its warm-up (critic.freeze_actor_steps) only it is.
        """
        if critic is None and self.acfg.advantage == "gae":
            raise ValueError("algo.advantage=gae needs a critic: pass critic= to Actor.train")
        with span("train", samples=len(batch)):
            if self._fused_old and critic is None:
                try:
                    return self._train(batch, fused=True)
                except _NonFiniteOld:
                    # the two-pass step leaves out (and counts) the samples with non-finite
                    # log-probs; no update was taken yet, so it starts over from the same state
                    self.optimizer.zero_grad(set_to_none=True)
            return self._train(batch, critic)

    def _train(
        self, batch: TrainBatch, critic: Critic | None = None, *, fused: bool = False
    ) -> dict[str, float]:
        start = time.perf_counter()
        batch = batch.to(self.device)
        budget = self.tcfg.micro_batch_tokens
        self.layouts.pick(batch.sequences, batch.response_lengths, budget)
        stats: dict[str, float] = {}
        if fused:
            old = None
        elif self.needs_recompute:
            old = self.logprobs(self.model, batch)
        else:
            old = batch.rollout_logprobs
        ref = self.logprobs(self.ref, batch) if self.ref is not None else None
        batch, old, ref, dropped = drop_nonfinite(batch, old, ref)
        mask = batch.response_mask
        stats["train/nonfinite_logprob_samples"] = float(dropped)
        if not mask.any():  # every sample had a non-finite log-prob: skip the step, counted
            self.skipped_steps += 1
            return {
                **stats,
                "train/skipped_steps": float(self.skipped_steps),
                "time/train": time.perf_counter() - start,
            }
        if self.needs_recompute and not fused:
            stats.update(mismatch(old, batch))
        elif self.tcfg.mini_batches > 1:
            # later mini-batches are trained after earlier updates; measure every row before any
            stats.update(mismatch(self.logprobs(self.model, batch), batch))
        if self.acfg.loss_agg == "seq-mean-token-sum-norm" and not self._warned_max_len:
            self._warned_max_len = warn_over_max_len(mask, self.max_len)
        token_rewards, weights = None, None
        if ref is not None:
            kind = self.acfg.kl.estimator
            kl_tok = algo.kl_penalty(old, ref, kind, mask=mask)
            stats["kl/ref"] = (kl_tok.sum() / mask.sum()).item()
            if self.acfg.kl.as_reward:
                token_rewards = algo.kl_token_rewards(
                    old, ref, mask, coef=self.kl_ctl.value, kind=kind
                )
                self.kl_ctl.update(stats["kl/ref"], len(batch))
                stats["kl/coef"] = self.kl_ctl.value
        if self.acfg.correction.mode != "none":
            c = self.acfg.correction
            corr = algo.rollout_correction(
                old, self._behavior(batch), mask, mode=c.mode, cap=c.cap, low=c.low, high=c.high
            )
            weights, mask = corr.weights, corr.mask
            stats.update({f"correction/{k}": v for k, v in corr.metrics.items()})
            if not mask.any():  # the correction rejected every token: nothing to learn from
                return {
                    **stats,
                    "train/empty_steps": 1.0,
                    "time/train": time.perf_counter() - start,
                }
        values: dict[str, torch.Tensor] = {}
        if critic is not None:
            values["values"], mask, critic_stats = critic.values(batch, mask)
            stats.update(critic_stats)
            if not mask.any():
                return {
                    **stats,
                    "train/empty_steps": 1.0,
                    "time/train": time.perf_counter() - start,
                }
        adv = step_advantages(  # the estimator, or algo.credit's two-level rule
            self.acfg.credit,
            self.advantage_fn,
            batch.samples,
            batch.rewards,
            mask,
            batch.group_ids,
            token_rewards=token_rewards,
            values=values.get("values"),
            options=self.acfg.advantage_options,
        )
        stats.update({f"adv/{k}": v for k, v in adv.metrics.items()})
        if adv.mask is not None:
            mask = adv.mask  # samples with non-finite rewards are excluded
        dead = self._dead_rows(mask, adv.advantages)
        if dead is not None:
            stats["train/dead_rows"] = float(dead.float().mean())
        if critic is not None:
            frozen = critic.actor_frozen
            stats.update(critic.train(batch, values["values"], adv.returns, mask))
            stats["critic/actor_frozen"] = float(frozen)
            if frozen:  # critic warm-up: the policy is not updated
                return {**stats, "time/train": time.perf_counter() - start}
        sums: dict[str, float] = defaultdict(float)
        grad_norms: list[float] = []
        peaks: dict[str, float] = {}
        n_tokens = 0.0
        self._mismatch_sums = [0.0, 0.0, 0.0]  # |engine - trainer|, tokens, k3 (fused only)
        for epoch in range(self.tcfg.epochs):
            order = torch.randperm(
                len(batch), generator=torch.Generator().manual_seed(self.updates + epoch)
            )
            for i, mb in enumerate(order.chunk(self.tcfg.mini_batches)):
                # the one forward that runs before any update measures the engine/trainer mismatch
                first = epoch == 0 and i == 0 and self.tcfg.mini_batches == 1
                metrics = self._update(
                    batch,
                    mb.sort().values.tolist(),
                    mask,
                    old,
                    ref,
                    adv.advantages,
                    weights,
                    first=first,
                    dead=dead,
                )
                tok = metrics.pop("_tokens")
                n_tokens += tok
                grad_norms.append(metrics.pop("grad_norm"))
                for k, v in metrics.pop("_peaks").items():
                    peaks[k] = max(peaks.get(k, float("-inf")), v)
                for k, v in metrics.items():
                    sums[k] += v * tok
        stats.update({k: v / max(n_tokens, 1.0) for k, v in sums.items()})
        stats.update(peaks)
        totals, _ = self._reduce_metrics(
            {"diff": self._mismatch_sums[0], "tokens": self._mismatch_sums[1]}, {}
        )
        if totals.get("tokens", 0.0):
            stats["mismatch/abs_logp_diff"] = totals["diff"] / totals["tokens"]
            if fused:
                stats["mismatch/kl"] = self._mismatch_sums[2] / totals["tokens"]
        finite = [g for g in grad_norms if math.isfinite(g)]
        stats["train/grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
        stats["train/skipped_updates"] = float(self.skipped_updates)
        stats["train/skipped_steps"] = float(self.skipped_steps)
        stats["train/lr"] = self.scheduler.get_last_lr()[0]
        elapsed = time.perf_counter() - start
        stats["time/train"] = elapsed
        stats["throughput/train_tokens_per_s"] = (
            sum(len(s) for s in batch.sequences) * self.tcfg.epochs / elapsed
        )
        return stats

    def _update(
        self, batch, mb, mask, old, ref, advantages, weights, *, first: bool, dead
    ) -> dict[str, float]:
        """Accumulate gradients over the micro-batches of mini-batch `mb`, then step. `dead`: the
        step's rows that cannot move the weights (`_dead_rows`)."""
        num_tokens = float(mask[mb].sum().item())
        sums: dict[str, float] = defaultdict(float)
        peaks: dict[str, float] = {}
        if num_tokens == 0:  # every token of this mini-batch was masked out: no update
            self.scheduler.step()
            self.updates += 1
            return {"grad_norm": float("nan"), "_tokens": 0.0, "_peaks": peaks}
        self.optimizer.zero_grad(set_to_none=True)
        with grad_mode(self.model, self.tcfg.gradient_checkpointing):
            self._accumulate(
                batch, mb, mask, old, ref, advantages, weights, first, sums, peaks, dead
            )
        sums, peaks = self._reduce_metrics(sums, peaks)
        with span("optimizer", cat="train"):
            params = [p for p in self.model.parameters() if p.grad is not None]
            clip = self.tcfg.grad_clip if self.tcfg.grad_clip is not None else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
            if hasattr(norm, "full_tensor"):  # sharded (FSDP2) gradients: a DTensor norm
                norm = norm.full_tensor()
            norm = norm.item()
            if math.isfinite(norm):
                self.optimizer.step()
            else:
                self.skipped_updates += 1
                self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        self.updates += 1
        return {**sums, "grad_norm": norm, "_tokens": num_tokens, "_peaks": peaks}

    def _accumulate(
        self, batch, mb, mask, old, ref, advantages, weights, first, sums, peaks, dead
    ) -> None:
        """Forward and backward over the micro-batches of mini-batch `mb`, adding up metrics."""
        seqs, lens = batch.sequences, batch.response_lengths
        step = _MiniBatch(batch, mask, old, ref, advantages, weights, first, sums, peaks)
        step.num_tokens = float(mask[mb].sum().item())
        step.num_seqs = float(mask[mb].any(1).sum().item())
        live = [i for i in mb if dead is None or not dead[i]]
        # the dead rows' forwards come first: a forward without a backward leaves an FSDP2 root
        # module unsharded, and gradients accumulated before it would miss the sharded parameters
        # the optimizer steps (seen: 2 of 46 tensors); the gradient micro-batches then reshard it
        rest = [i for i in mb if dead is not None and dead[i]]
        if self.tcfg.dead_rows == "skip" and live:
            # the loss's normalisers above still count their tokens and rows; a step of dead rows
            # only runs their forward, so that every step has its metrics (mismatch, entropy)
            rest = []
        step.metric_tokens = float(mask[live + rest].sum().item())
        runs = [(idx, False) for idx in self._micro_batches(rest, seqs, lens)] if rest else []
        if live:
            runs += [(idx, True) for idx in self._micro_batches(live, seqs, lens)]
        for idx, grad in runs:
            finite = True
            if idx:
                finite = self._micro_step(step, idx, grad)
            else:
                self._idle_pass(self.model, backward=grad)
            # a fused step that met a non-finite log-prob restarts on every rank together; the
            # check follows the micro-batch's backward, so every rank's collectives run in the
            # same order (forward, backward, this all-reduce)
            if old is None and not self._all_finite(finite):
                raise _NonFiniteOld
        if not live:  # a zero gradient, on which AdamW still steps (its moments decay)
            self._settle()
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)

    def _micro_step(self, step: _MiniBatch, idx: list[int], grad: bool) -> bool:
        """Forward micro-batch `idx` (and backward, with `grad`), adding up its metrics; False
        when its log-probs were not finite."""
        batch, mask, old, ref = step.batch, step.mask, step.old, step.ref
        advantages, weights, sums, peaks = step.advantages, step.weights, step.sums, step.peaks
        num_tokens, num_seqs = step.num_tokens, step.num_seqs
        seqs, lens, vis = batch.sequences, batch.response_lengths, batch.visions
        width = mask.shape[1]
        with span("forward", cat="train", sequences=len(idx)), torch.set_grad_enabled(grad):
            out = self._forward(
                self.model,
                [seqs[i] for i in idx],
                [lens[i] for i in idx],
                with_entropy=True,
                entropy_grad=self.acfg.entropy_coef != 0,
                pad_to=width,
                visions=[vis[i] for i in idx],
            )
        m = mask[idx]
        finite = finite_forward(out, m)
        if not grad and not finite:
            return False  # no gradient from these rows: an overflow in them cannot reach it
        if not finite:
            # an overflow in this forward: backward a NaN loss, so that the gradient norm is
            # NaN on every rank (collectives stay in step) and `_update` skips this update
            # and counts it in train/skipped_updates, instead of a check stopping the run
            with span("backward", cat="train"):
                (out.logprobs.nan_to_num().sum() * float("nan")).backward()
            return False
        old_mb = out.logprobs.detach() if old is None else old[idx]
        kl_in_loss = ref is not None and not self.acfg.kl.as_reward
        loss, pg = algo.compute_policy_loss(
            self.loss_fn,
            out.logprobs,
            old_mb,
            advantages[idx],
            m,
            agg=self.acfg.loss_agg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_len=self.max_len,
            behavior_logp=self._behavior(batch)[idx]
            if self.acfg.policy_loss == "decoupled_ppo"
            else None,
            weights=None if weights is None else weights[idx],
            ref_logp=ref[idx] if kl_in_loss else None,
            kl_coef=self.kl_ctl.value if kl_in_loss else 0.0,
            kl_kind=self.acfg.kl.estimator,
            entropy=out.entropy,
            entropy_coef=self.acfg.entropy_coef,
            **self.loss_options,
        )
        if grad:
            with span("backward", cat="train"):
                loss.backward()
        share = float(m.sum().item()) / max(step.metric_tokens, 1.0)
        add_loss_metrics(sums, peaks, loss.item(), pg, share)
        if step.first and (old is None or not self.needs_recompute):
            trained = batch.response_mask[idx] if old is None else m
            policy = trained * (batch.versions[idx] >= 0)
            behaviour = batch.rollout_logprobs[idx]
            diff = (out.logprobs.detach() - behaviour) * policy
            self._mismatch_sums[0] += diff.abs().sum().item()
            self._mismatch_sums[1] += policy.sum().item()
            if old is None:  # the k3 KL that `_mismatch` reports for a separate pass
                k3 = algo.kl_penalty(behaviour, out.logprobs.detach(), "k3") * policy
                self._mismatch_sums[2] += k3.sum().item()
        return True

    def _dead_rows(self, mask: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor | None:
        """(B,) True for rows whose gradient is exactly zero, or None when that cannot be known.

        Every built-in policy loss is the advantage times a function of the log-probs, per token
        (per sequence for GSPO), so a row whose trained tokens all have A = 0 (a GRPO group with
        equal rewards, a masked-out sample) adds exactly 0 to the gradient unless an entropy bonus
        or a KL term in the loss depends on its log-probs. Such rows take no backward, and no
        forward either unless `train.dead_rows=forward` asks for metrics over every row. A user's
        loss (a dotted path) may depend on more, so with one every row trains.
        """
        if (
            not self.skips_dead_backward
            or self.acfg.entropy_coef != 0
            or (self.ref is not None and not self.acfg.kl.as_reward)
            or not isinstance(self.acfg.policy_loss, str)
            or self.acfg.policy_loss not in algo.POLICY_LOSSES
        ):
            return None
        return ~((advantages != 0) & (mask > 0)).any(1)

    def _behavior(self, batch: TrainBatch) -> torch.Tensor:
        """The behaviour policy's log-probs per `algo.behavior_logprobs` (see the schema)."""
        if self.acfg.behavior_logprobs == "sampled":
            return batch.sampled_logprobs
        return batch.rollout_logprobs

    def state_dict(self) -> dict:
        """Optimizer, schedule, KL coefficient and update counters: with the model weights, all a
        checkpoint needs to continue training exactly."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "kl_coef": self.kl_ctl.value,
            "updates": self.updates,
            "skipped_updates": self.skipped_updates,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_ctl.value = state["kl_coef"]
        self.updates, self.skipped_updates = state["updates"], state["skipped_updates"]
        self.skipped_steps = state.get("skipped_steps", 0)

    def weights(self):
        """Named parameters to push to the engines."""
        return self.model.named_parameters()


@dataclass
class _MiniBatch:
    """What every micro-batch of one mini-batch's update reads, and the metric sums it adds to."""

    batch: TrainBatch
    mask: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    advantages: torch.Tensor
    weights: torch.Tensor | None
    first: bool
    sums: dict[str, float]
    peaks: dict[str, float]
    num_tokens: float = 0.0
    num_seqs: float = 0.0
    metric_tokens: float = 0.0
    """Trained tokens of the rows whose forward runs: the weights of per-token metric means."""


class _NonFiniteOld(Exception):
    """A fused step met a non-finite trainer log-prob: redo the step with a separate old pass."""
