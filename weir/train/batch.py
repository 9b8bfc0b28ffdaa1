"""From scored groups to a training batch: flatten, drop what cannot be trained, pad per-token lists."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from weir.data.sample import Group, Sample
from weir.data.vision import VisionInputs


@dataclass
class TrainBatch:
    """Samples of one RL step and their per-token tensors, (B, T) with T the longest response."""

    samples: list[Sample]
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    versions: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    behavior_logprobs: torch.Tensor | None = None
    """Log-probs under the top-k/top-p truncated distribution the engine sampled from; None when
    no sample was filtered (then `rollout_logprobs` are the behaviour policy's)."""

    def __len__(self) -> int:
        return len(self.samples)

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with its tensors on `device` (self when they already are)."""
        device = torch.device(device)
        if self.response_mask.device == device:
            return self
        names = ("response_mask", "rollout_logprobs", "versions", "rewards", "group_ids")
        moved = {n: getattr(self, n).to(device, non_blocking=True) for n in names}
        if self.behavior_logprobs is not None:
            moved["behavior_logprobs"] = self.behavior_logprobs.to(device, non_blocking=True)
        return TrainBatch(samples=self.samples, metrics=self.metrics, **moved)

    @property
    def sampled_logprobs(self) -> torch.Tensor:
        """The behaviour policy's log-probs: under the distribution each token was drawn from."""
        return self.rollout_logprobs if self.behavior_logprobs is None else self.behavior_logprobs

    # computed once per batch (a step reads them in every micro-batch): `samples` is not changed
    # after the batch is made, and `to` / `dataclasses.replace` make a new batch
    @functools.cached_property
    def sequences(self) -> list[list[int]]:
        return [s.prompt_ids + s.response_ids for s in self.samples]

    @functools.cached_property
    def visions(self) -> list[VisionInputs | None]:
        """Each sample's pixel inputs (None for a prompt without images)."""
        return [s.vision for s in self.samples]

    @functools.cached_property
    def response_lengths(self) -> list[int]:
        return [len(s.response_ids) for s in self.samples]


def _pad(rows: list[list[float]], width: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def make_batch(groups: list[Group], *, version: int) -> TrainBatch | None:
    """Flatten groups into a TrainBatch; failed, unrewarded or empty samples are left out and counted.

    `version` is the trainer's current weight version; token staleness is version - token version.
    Returns None when no sample is trainable (e.g. the filter dropped every group).
    """
    kept: list[Sample] = []
    dropped = 0
    for g in groups:
        for s in g.samples:
            trainable = s.ok and s.response_ids and any(s.loss_mask) and math.isfinite(s.reward)
            if trainable:
                kept.append(s)
            else:
                dropped += 1
    if not kept:
        return None
    width = max(len(s.response_ids) for s in kept)
    mask = _pad([s.loss_mask for s in kept], width, 0, torch.float32)
    versions = _pad([s.versions for s in kept], width, -1, torch.long)
    policy_tokens = (versions >= 0) & (mask > 0)
    behind = (version - versions).clamp(min=0)[policy_tokens].float()
    metrics = staleness_histogram(behind)
    metrics |= {
        "batch/samples": float(len(kept)),
        "batch/dropped_samples": float(dropped),
        "batch/trained_tokens": float(mask.sum().item()),
        "staleness/mean": behind.mean().item() if behind.numel() else 0.0,
        "staleness/max": behind.max().item() if behind.numel() else 0.0,
    }
    return TrainBatch(
        samples=kept,
        response_mask=mask,
        rollout_logprobs=_pad([s.rollout_logprobs for s in kept], width, 0.0, torch.float32),
        versions=versions,
        rewards=torch.tensor([s.reward for s in kept], dtype=torch.float32),
        group_ids=advantage_groups(kept),
        metrics=metrics,
        behavior_logprobs=_pad(
            [
                s.rollout_logprobs if s.behavior_logprobs is None else s.behavior_logprobs
                for s in kept
            ],
            width,
            0.0,
            torch.float32,
        )
        if any(s.behavior_logprobs is not None for s in kept)
        else None,
    )


def advantage_groups(samples: list[Sample]) -> torch.Tensor:
    """The group id of each sample for group-relative advantages: its `group_id`, or, for the role
    views of a multi-agent episode, one group per (group_id, role), so each role gets its own
    baseline (GRPO's mean and std are taken over that role's samples of the prompt only)."""
    keys = [(s.group_id, s.metadata.get("role")) for s in samples]
    if all(role is None for _, role in keys):
        return torch.tensor([g for g, _ in keys], dtype=torch.long)
    ids = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    return torch.tensor([ids[k] for k in keys], dtype=torch.long)


def staleness_histogram(behind: torch.Tensor) -> dict[str, float]:
    """Fraction of trained policy tokens that are k versions behind, as `staleness/hist_k`."""
    if not behind.numel():
        return {}
    values, counts = torch.unique(behind.long(), return_counts=True)
    return {
        f"staleness/hist_{int(v)}": c.item() / behind.numel()
        for v, c in zip(values, counts, strict=True)
    }


def mask_stale_prefix(groups: list[Group]) -> int:
    """Keep each sample's tokens from older weight versions as context but out of the loss.

    A response interrupted by a weight update has a prefix from version v and a suffix from
    v' > v; only tokens from the sample's newest version stay trained. Returns the tokens masked.
    """
    masked = 0
    for g in groups:
        for s in g.samples:
            produced = [v for v, m in zip(s.versions, s.loss_mask, strict=True) if m and v >= 0]
            if not produced:
                continue
            newest = max(produced)
            for i, v in enumerate(s.versions):
                if s.loss_mask[i] and 0 <= v < newest:
                    s.loss_mask[i] = 0
                    masked += 1
    return masked
