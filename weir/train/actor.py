"""The actor: log-probs, advantages and policy-gradient updates on packed micro-batches.

One `train(batch)` call is one RL step: recompute old / reference log-probs if configured,
compute advantages, then `epochs x mini_batches` optimizer steps, each accumulating gradients over
packed micro-batches. Loss aggregation uses the token / sequence counts of the whole mini-batch, so
the gradient does not depend on how it was split into micro-batches.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from weir import algo
from weir.data.moe_routing import Routes, install_routing
from weir.telemetry.timeline import span
from weir.train.actor_hooks import ProcessHooks
from weir.train.actor_settings import (
    ActorSettings,
    check_algo_options,
    correction_settings,
    kl_controller,
    zero_gradient_rows,
)
from weir.train.batch import TrainBatch
from weir.train.credit import step_advantages
from weir.train.fuse import apply_fusion
from weir.train.layout_cost import LayoutChoice
from weir.train.memory_plan import planned_train_config
from weir.train.modes import grad_mode, prepare_for_training
from weir.train.optim import make_optimizer, make_schedule
from weir.train.packing import (
    Layout,
    prefix_refusal,
    prefix_refused_unprobed,
    response_logprobs,
)
from weir.train.response_rows import check_kernel, logprob_kernel, to_device
from weir.train.step_checks import (
    MicroBatchRecords,
    MiniBatch,
    drop_nonfinite,
    finite_flag,
    mismatch,
    mismatch_spread,
    warn_over_max_len,
)
from weir.train.teacher import distill_advantages, distill_loss, make_teacher

if TYPE_CHECKING:
    from weir.train.critic import Critic


class Actor(ProcessHooks):
    """Policy model, optimizer and schedule, plus an optional frozen reference for KL and a
    distillation teacher."""

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
        # train.mixed_precision=compute_copy: forwards and backwards on a compute-dtype copy
        self._copy = self._compute_copy(model)
        # train.memory=plan: checkpointing and the micro-batch budget from the memory model
        self.tcfg = planned_train_config(self.tcfg, model, self.device, self.precision)
        self.model = prepare_for_training(model, checkpointing=self.tcfg.gradient_checkpointing)
        check_kernel(self.tcfg.logprob_kernel, self.device)
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
        self.correction = correction_settings(self.acfg.correction)
        self.ref = self._reference(model) if settings.needs_reference else None
        # algo.routing_replay: the policy's (and reference's) forwards replay the engine's routing
        self.routing = install_routing(self.model) if self.acfg.routing_replay else None
        if self.routing is not None and self.ref is not None:
            install_routing(self.ref)
        self.teacher = make_teacher(self)
        self.kl_ctl = kl_controller(self.acfg.kl)
        self.fusion = apply_fusion(self.tcfg.fuse, self.model, self.device)
        if self._layouts is not None and self.fusion.route == "compile":  # prefix runs uncompiled
            self._layouts = self._layout_choice(self._layouts.candidates)
        if self.ref is not None:  # a deep copy: uncompiled, and unfused if made before
            apply_fusion(self.tcfg.fuse, self.ref, self.device, quiet=True)
        self.skipped_updates = 0
        self.skipped_steps = 0
        self.updates = 0
        check_algo_options(
            self.acfg, self.advantage_fn, self.loss_fn, self.max_len, self.loss_options
        )

    def _routes(self, batch: TrainBatch, idx: list[int]) -> Routes | None:
        """The engine's recorded routing of rows `idx`, to replay (None: `algo.routing_replay` off)."""
        if self.routing is None:
            return None
        seqs = [batch.samples[i].routed_experts for i in idx]
        return Routes(seqs, self.routing.layers, self.routing.top_k)

    def _forward(
        self, model: torch.nn.Module, seqs, lens, *, layout=None, temperature=None, **kwargs
    ):
        """Response log-probs of one micro-batch in the configured layout, compute dtype and
        log-prob kernel (or `layout` and `temperature`: a distillation teacher's)."""
        with self._computing(model), logprob_kernel(self.tcfg.logprob_kernel):
            return response_logprobs(
                model,
                seqs,
                lens,
                layout=layout or self.layout,
                temperature=self.temperature if temperature is None else temperature,
                chunk_size=self.tcfg.logprob_chunk_tokens,
                one_pass=self.prefix_one_pass,
                **kwargs,
            )

    @property
    def needs_recompute(self) -> bool:
        return (
            self.acfg.old_logprobs == "recompute"
            or self.acfg.policy_loss == "decoupled_ppo"
            or self.correction["mode"] != "none"
        )

    @torch.no_grad()
    def logprobs(
        self,
        model: torch.nn.Module,
        batch: TrainBatch,
        *,
        temperature: float | None = None,
        layout: Layout | None = None,
        replay: bool = True,
    ) -> torch.Tensor:
        """(B, T) log-probs of the batch's response tokens under `model`, without gradients, on the
        trainer's device (`temperature`, `layout`: a distillation teacher's, else the policy's;
        `replay`: the engine's recorded routing, with `algo.routing_replay`)."""
        batch = batch.to(self.device)
        out = torch.zeros_like(batch.response_mask)
        seqs, lens, vis = batch.sequences, batch.response_lengths, batch.visions
        with self._computing(model):  # one compute copy for every micro-batch
            for idx in self._micro_batches(list(range(len(seqs))), seqs, lens, layout):
                if not idx:
                    self._idle_pass(model, backward=False, layout=layout)
                    continue
                with span("logprobs", cat="train", sequences=len(idx)):
                    res = self._forward(
                        model,
                        [seqs[i] for i in idx],
                        [lens[i] for i in idx],
                        layout=layout,
                        temperature=temperature,
                        pad_to=out.shape[1],
                        visions=[vis[i] for i in idx],
                        routes=self._routes(batch, idx) if replay else None,
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
            and self.correction["mode"] == "none"
            and self.acfg.kl.coef == 0
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
        ref = self.logprobs(self.ref, batch) if self.acfg.kl.coef > 0 else None
        teacher = None
        if self.teacher is not None:
            with span("teacher", cat="train"):
                t0 = time.perf_counter()
                teacher = self.teacher.logprobs(batch)
                stats["time/teacher"] = time.perf_counter() - t0
        batch, old, ref, teacher, dropped = drop_nonfinite(batch, old, ref, teacher)
        mask = batch.response_mask
        stats["train/nonfinite_logprob_samples"] = float(dropped)
        if (
            self.routing is not None
        ):  # samples the engine recorded no routing for route by themselves
            stats["routing/unrecorded_samples"] = float(
                sum(s.routed_experts is None for s in batch.samples)
            )
        if not mask.any():  # every sample had a non-finite log-prob: skip the step, counted
            self.skipped_steps += 1
            return {
                **stats,
                "train/skipped_steps": float(self.skipped_steps),
                "time/train": time.perf_counter() - start,
            }
        if self.needs_recompute and not fused:
            stats.update(mismatch(old, batch))
            stats.update(mismatch_spread(old, self._behavior(batch), batch))
        elif self.tcfg.mini_batches > 1:
            # later mini-batches are trained after earlier updates; measure every row before any
            before = self.logprobs(self.model, batch)
            stats.update(mismatch(before, batch))
            stats.update(mismatch_spread(before, self._behavior(batch), batch))
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
        if self.correction["mode"] != "none":
            corr = algo.rollout_correction(old, self._behavior(batch), mask, **self.correction)
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
        advantages = adv.advantages
        if teacher is not None:
            advantages, distill_stats = distill_advantages(
                self.acfg.distill, advantages, self._behavior(batch), teacher, mask
            )
            stats.update(distill_stats)
        dead_rows = self._dead_rows(mask, advantages)
        dead = None if dead_rows is None else dead_rows.tolist()  # one read, not one per row
        if dead is not None:
            stats["train/dead_rows"] = sum(dead) / max(len(dead), 1)
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
        self._step_teacher = teacher if self.acfg.distill.mode == "loss" else None
        self._first_logp = torch.zeros_like(batch.rollout_logprobs)  # the first forward's rows
        self._first_rows = torch.zeros(len(batch), device=self.device)
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
                    advantages,
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
            rows = self._combine_rows(self._first_rows)
            first = self._combine_rows(self._first_logp)
            stats.update(mismatch_spread(first, self._behavior(batch), batch, rows > 0))
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
        """Accumulate gradients over the micro-batches of mini-batch `mb`, then step. `dead`: per
        row of the step, whether it cannot move the weights (`_dead_rows`), or None.

        The device is read twice per update, whatever the number of micro-batches: the
        mini-batch's counts before it, and the gradient norm with every micro-batch's metrics
        and finiteness (`weir.train.step_checks.MicroBatchRecords`) after it."""
        live = [i for i in mb if dead is None or not dead[i]]
        # the dead rows' forwards come first: a forward without a backward leaves an FSDP2 root
        # module unsharded, and gradients accumulated before it would miss the sharded parameters
        # the optimizer steps (seen: 2 of 46 tensors); the gradient micro-batches then reshard it
        rest = [i for i in mb if dead is not None and dead[i]]
        if self.tcfg.dead_rows == "skip" and live:
            # the loss's normalisers still count their tokens and rows; a step of dead rows only
            # runs their forward, so that every step has its metrics (mismatch, entropy)
            rest = []
        rows = to_device(torch.tensor(mb), mask.device)
        ran = to_device(torch.tensor(live + rest), mask.device)
        m = mask.index_select(0, rows)
        counts = torch.stack(
            [m.sum().float(), m.any(1).sum().float(), mask.index_select(0, ran).sum().float()]
        )
        num_tokens, num_seqs, metric_tokens = counts.tolist()
        sums: dict[str, float] = defaultdict(float)
        peaks: dict[str, float] = {}
        if num_tokens == 0:  # every token of this mini-batch was masked out: no update
            self.scheduler.step()
            self.updates += 1
            return {"grad_norm": float("nan"), "_tokens": 0.0, "_peaks": peaks}
        self.optimizer.zero_grad(set_to_none=True)
        step = MiniBatch(batch, mask, old, ref, advantages, weights, first, num_tokens, num_seqs)
        step.records = MicroBatchRecords(metric_tokens)
        with grad_mode(self.model, self.tcfg.gradient_checkpointing):
            self._accumulate(step, live, rest)
        finite = self._all_finite(step.records.finite())
        with span("optimizer", cat="train"):
            params = [p for p in self.model.parameters() if p.grad is not None]
            clip = self.tcfg.grad_clip if self.tcfg.grad_clip is not None else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
            if hasattr(norm, "full_tensor"):  # sharded (FSDP2) gradients: a DTensor norm
                norm = norm.full_tensor()
            norm, all_finite = step.records.read(norm, finite)  # the one read of the update
            # a fused step that met a non-finite log-prob restarts (on every rank together: the
            # flag was reduced over the ranks); nothing was stepped yet
            if old is None and not all_finite:
                raise _NonFiniteOld
            step.records.add_to(sums, peaks, self._mismatch_sums)
            sums, peaks = self._reduce_metrics(sums, peaks)
            if math.isfinite(norm):
                self.optimizer.step()
            else:
                self.skipped_updates += 1
                self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        self.updates += 1
        return {**sums, "grad_norm": norm, "_tokens": num_tokens, "_peaks": peaks}

    def _accumulate(self, step: MiniBatch, live: list[int], rest: list[int]) -> None:
        """Forward and backward over the micro-batches of rows `live` (and forwards only over
        `rest`, the dead rows whose metrics are wanted), recording their metrics."""
        seqs, lens = step.batch.sequences, step.batch.response_lengths
        runs = [(idx, False) for idx in self._micro_batches(rest, seqs, lens)] if rest else []
        if live:
            runs += [(idx, True) for idx in self._micro_batches(live, seqs, lens)]
        # one compute copy for every micro-batch; its gradients are in the masters when it ends
        with self._computing(self.model):
            for idx, grad in runs:
                if idx:
                    self._micro_step(step, idx, grad)
                else:
                    self._idle_pass(self.model, backward=grad)
        if not live:  # a zero gradient, on which AdamW still steps (its moments decay)
            self._settle()
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)

    def _micro_step(self, step: MiniBatch, idx: list[int], grad: bool) -> None:
        """Forward micro-batch `idx` (and backward, with `grad`), recording its metrics and
        whether its log-probs were finite, without reading the device.

        A non-finite log-prob on a trained token poisons the backward (a NaN times the
        log-probs' sum joins the loss), so that the gradient norm is NaN on every rank
        (collectives stay in step) and `_update` skips the update and counts it in
        train/skipped_updates, instead of a check stopping the run; its metrics are left out."""
        batch, old, ref = step.batch, step.old, step.ref
        seqs, lens, vis = batch.sequences, batch.response_lengths, batch.visions
        rows = to_device(torch.tensor(idx), step.mask.device)
        pick = lambda x: x.index_select(0, rows)  # noqa: E731
        with span("forward", cat="train", sequences=len(idx)), torch.set_grad_enabled(grad):
            out = self._forward(
                self.model,
                [seqs[i] for i in idx],
                [lens[i] for i in idx],
                with_entropy=True,
                entropy_grad=self.acfg.entropy_coef != 0,
                pad_to=step.mask.shape[1],
                visions=[vis[i] for i in idx],
                routes=self._routes(batch, idx),
            )
        m = pick(step.mask)
        finite = finite_flag(out, m)
        old_mb = out.logprobs.detach() if old is None else pick(old)
        kl_in_loss = ref is not None and not self.acfg.kl.as_reward
        loss, pg = algo.policy_loss_terms(
            self.loss_fn,
            out.logprobs,
            old_mb,
            pick(step.advantages),
            m > 0,
            agg=self.acfg.loss_agg,
            num_tokens=step.num_tokens,
            num_seqs=step.num_seqs,
            max_len=self.max_len,
            behavior_logp=pick(self._behavior(batch))
            if self.acfg.policy_loss == "decoupled_ppo"
            else None,
            weights=None if step.weights is None else pick(step.weights),
            ref_logp=pick(ref) if kl_in_loss else None,
            kl_coef=self.kl_ctl.value if kl_in_loss else 0.0,
            kl_kind=self.acfg.kl.estimator,
            entropy=out.entropy,
            entropy_coef=self.acfg.entropy_coef,
            **self.loss_options,
        )
        if self._step_teacher is not None:  # algo.distill.mode=loss: the reverse KL as a term
            loss = loss + distill_loss(
                self.acfg.distill,
                out.logprobs,
                pick(self._step_teacher),
                m,
                agg=self.acfg.loss_agg,
                num_tokens=step.num_tokens,
                num_seqs=step.num_seqs,
                max_len=self.max_len,
            )
        if grad:
            poison = torch.where(finite, 0.0, float("nan"))
            with span("backward", cat="train"):
                (loss + poison * out.logprobs.nan_to_num().sum()).backward()
        mismatch = None
        if step.first and (old is None or not self.needs_recompute):
            trained = pick(batch.response_mask) if old is None else m
            policy = trained * (pick(batch.versions) >= 0)
            behaviour = pick(batch.rollout_logprobs)
            logp = out.logprobs.detach()
            mismatch = [((logp - behaviour) * policy).abs().sum(), policy.sum()]
            if old is None:  # the k3 KL that `mismatch` reports for a separate pass
                mismatch.append((algo.kl_penalty(behaviour, logp, "k3") * policy).sum())
            # the first forward's log-probs, for the ratios' spread (`mismatch_spread`)
            self._first_logp.index_copy_(0, rows, logp.to(self._first_logp.dtype))
            self._first_rows.index_fill_(0, rows, 1.0)
        step.records.add(finite, loss, pg, mismatch)

    def _dead_rows(self, mask: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor | None:
        """(B,) True for rows that take no backward (`actor_settings.zero_gradient_rows`)."""
        if not self.skips_dead_backward:
            return None
        distills = self.teacher is not None and self.acfg.distill.mode == "loss"
        return zero_gradient_rows(self.acfg, distills, mask, advantages)

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


class _NonFiniteOld(Exception):
    """A fused step met a non-finite trainer log-prob: redo the step with a separate old pass."""
