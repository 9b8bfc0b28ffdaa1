"""Checks on a step's log-probs: non-finite values contained, engine/trainer mismatch measured, and
the Dr.GRPO normaliser checked against the responses actually trained.

A non-finite log-prob (an overflow in the engine, the trainer or the reference) costs its sample,
never the run: `drop_nonfinite` masks the sample out and counts it; `finite_flag` tells the actor
when its own gradient forward overflowed, so that it skips (and counts) that update.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from weir import algo
from weir.train.batch import TrainBatch

__all__ = [
    "finite_flag",
    "MicroBatchRecords",
    "MiniBatch",
    "drop_nonfinite",
    "mismatch",
    "mismatch_spread",
    "warn_over_max_len",
]


def finite_flag(out, mask: torch.Tensor) -> torch.Tensor:
    """Whether the trainer's log-probs (and entropy) are finite on every trained token: a 0-d
    bool tensor on their device (read with the update's other values, `MicroBatchRecords`)."""
    m = mask > 0
    ok = (torch.isfinite(out.logprobs.detach()) | ~m).all()
    if out.entropy is not None:
        ok &= (torch.isfinite(out.entropy.detach()) | ~m).all()
    return ok


class MicroBatchRecords:
    """The metrics of one update's micro-batches, kept on the device until the update reads them
    all at once with its gradient norm (`read`): one host synchronisation per update instead of
    several per micro-batch.

    Per micro-batch: whether its log-probs were finite, its loss, the policy loss's metrics
    (`weir.algo.policy_loss_terms`) and, on the step's first forward, the engine/trainer
    mismatch sums (|diff|, tokens, k3). `metric_tokens`: the trained tokens of the rows whose
    forward runs, the weights of per-token metric means."""

    def __init__(self, metric_tokens: float) -> None:
        self.metric_tokens = metric_tokens
        self._rows: list[tuple[list[str], torch.Tensor]] = []
        self._flags: list[torch.Tensor] = []
        self._flags_read: list[bool] = []
        self._values: list[float] = []

    def add(
        self,
        finite: torch.Tensor,
        loss: torch.Tensor,
        pg: dict[str, torch.Tensor],
        mismatch: list[torch.Tensor] | None,
    ) -> None:
        keys = ["loss", *pg, *(f"_mismatch{i}" for i in range(len(mismatch or [])))]
        values = [loss.detach(), *pg.values(), *(mismatch or [])]
        self._rows.append((keys, torch.stack([v.reshape(()).float() for v in values])))
        self._flags.append(finite)

    def finite(self) -> torch.Tensor:
        """A device flag: every micro-batch recorded so far was finite (True with none)."""
        if not self._flags:
            return torch.ones((), dtype=torch.bool)
        return torch.stack(self._flags).all()

    def read(self, norm: torch.Tensor, finite: torch.Tensor) -> tuple[float, bool]:
        """The one read of the update: the gradient norm, the (rank-reduced) `finite` flag, the
        per-micro-batch flags and every recorded value; returns (norm, finite)."""
        parts = [norm.reshape(1).float(), finite.reshape(1).float().to(norm.device)]
        parts += [torch.stack(self._flags).float().to(norm.device)] if self._flags else []
        parts += [v.to(norm.device) for _, v in self._rows]
        values = torch.cat(parts).tolist()
        n = len(self._flags)
        self._flags_read = [v > 0 for v in values[2 : 2 + n]]
        self._values = values[2 + n :]
        return values[0], values[1] > 0

    def add_to(
        self, sums: dict[str, float], peaks: dict[str, float], mismatch: list[float]
    ) -> None:
        """Add every finite micro-batch's metrics (after `read`) to the update's `sums` / `peaks`
        (`add_loss_metrics`) and its mismatch sums to `mismatch`. A non-finite one is left out:
        its gradient is NaN (the update is skipped) or the fused step restarts."""
        at = 0
        for (keys, row), ok in zip(self._rows, self._flags_read, strict=True):
            values = dict(zip(keys, self._values[at : at + row.numel()], strict=True))
            at += row.numel()
            if not ok:
                continue
            for i in range(3):
                mismatch[i] += values.pop(f"_mismatch{i}", 0.0)
            bad = [k for k, v in values.items() if not math.isfinite(v)]
            if bad:
                raise ValueError(
                    f"the policy loss produced non-finite {', '.join(bad)} from finite inputs"
                )
            loss = values.pop("loss")
            share = values.get("tokens", 0.0) / max(self.metric_tokens, 1.0)
            add_loss_metrics(sums, peaks, loss, values, share)


def drop_nonfinite(
    batch: TrainBatch,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    teacher: torch.Tensor | None = None,
) -> tuple[TrainBatch, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int]:
    """Leave out (mask) every sample with a non-finite log-prob on a trained token, from the engine,
    the trainer, the reference or a distillation teacher; returns the cleaned batch, old, ref and
    teacher log-probs and how many samples were left out. `old` None: the step takes them from its
    own forward (the actor's fused step), which checks them itself."""
    m = batch.response_mask.bool()
    bad = (~torch.isfinite(batch.rollout_logprobs) & m).any(1)
    if batch.behavior_logprobs is not None:
        bad |= (~torch.isfinite(batch.behavior_logprobs) & m).any(1)
    for t in (old, ref, teacher):
        if t is not None:
            bad |= (~torch.isfinite(t) & m).any(1)
    n = int(bad.sum().item())
    if n == 0:
        return batch, old, ref, teacher, 0
    keep = (~bad).unsqueeze(1)

    def clean(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.where(keep & torch.isfinite(t), t, 0.0)

    old_is_rollout = old is batch.rollout_logprobs
    batch = dataclasses.replace(
        batch,
        response_mask=batch.response_mask * keep,
        rollout_logprobs=clean(batch.rollout_logprobs),
        behavior_logprobs=clean(batch.behavior_logprobs),
    )
    old = batch.rollout_logprobs if old_is_rollout else clean(old)
    return batch, old, clean(ref), clean(teacher), n


def mismatch(trainer_logp: torch.Tensor, batch: TrainBatch) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's on the same policy tokens (before the
    update): mean |log pi_trainer - log pi_engine| and the k3 estimate of KL(engine || trainer)."""
    m = batch.response_mask * (batch.versions >= 0)
    n = m.sum().clamp(min=1)
    d = (trainer_logp - batch.rollout_logprobs) * m
    k3 = algo.kl_penalty(batch.rollout_logprobs, trainer_logp, "k3") * m
    return {
        "mismatch/abs_logp_diff": (d.abs().sum() / n).item(),
        "mismatch/kl": (k3.sum() / n).item(),
    }


def mismatch_spread(
    trainer_logp: torch.Tensor,
    behaviour: torch.Tensor,
    batch: TrainBatch,
    rows: torch.Tensor | None = None,
) -> dict[str, float]:
    """The spread of the importance ratios trainer / engine on the policy tokens, as the correction
    presets see it (`weir.algo.mismatch_diagnostics`: ratio quantiles, the share outside each
    preset's band, the preset the run needs), as `mismatch/*`. `rows`: (B,) bool, the rows whose
    `trainer_logp` were computed (default: all)."""
    m = (batch.response_mask > 0) & (batch.versions >= 0)
    if rows is not None:
        m &= rows.bool().unsqueeze(1)
    diag = algo.mismatch_diagnostics(trainer_logp, behaviour, m, validate=False)
    return {f"mismatch/{k}": v for k, v in diag.items()}


def add_loss_metrics(
    sums: dict[str, float], peaks: dict[str, float], loss: float, pg: dict[str, float], share: float
) -> None:
    """Add one micro-batch's policy-loss metrics to its mini-batch's: `pg_loss`, already normalised
    by the mini-batch's counts, as a sum; `*_max` as maxima; the others as means over the trained
    tokens, weighted by `share` (the micro-batch's fraction of those tokens)."""
    sums["train/loss"] += loss
    for k, v in pg.items():
        if k in ("loss", "tokens"):
            continue
        key = f"train/{k}" if k in ("entropy", "kl_ref") else f"policy/{k}"
        if k == "pg_loss":
            sums[key] += v
        elif k.endswith("_max"):
            peaks[key] = max(peaks.get(key, float("-inf")), v)
        else:
            sums[key] += v * share


def warn_over_max_len(mask: torch.Tensor, max_len: int) -> bool:
    """Warn when a sample trains more tokens than the Dr.GRPO normaliser `max_len` assumes;
    returns whether it warned (the actor warns once per run)."""
    longest = int(mask.sum(1).max().item())
    if longest <= max_len:
        return False
    warnings.warn(
        f"algo.loss_agg=seq-mean-token-sum-norm: a sample trains {longest} tokens, more than the "
        f"normaliser max_len={max_len}; set algo.loss_options.max_len to the longest possible "
        "response",
        stacklevel=3,
    )
    return True


@dataclasses.dataclass
class MiniBatch:
    """What every micro-batch of one mini-batch's update reads, and where it records metrics."""

    batch: TrainBatch
    mask: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    advantages: torch.Tensor
    weights: torch.Tensor | None
    first: bool
    num_tokens: float
    num_seqs: float
    records: MicroBatchRecords | None = None
