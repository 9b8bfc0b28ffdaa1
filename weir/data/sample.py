"""The token-based unit that crosses every boundary: `Sample`, and the `Group` of one prompt's samples.

Text is derived from ids, never re-tokenized on the way to the trainer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from weir.data.vision import VisionInputs


class Status(str, enum.Enum):
    COMPLETED = "completed"  # the engine emitted a stop token
    TRUNCATED = "truncated"  # hit max_new_tokens or the context limit
    ABORTED = "aborted"  # cancelled (e.g. by a weight update with policy "abort")
    FAILED = "failed"  # the engine, reward or environment raised; see `error`


@dataclass
class Sample:
    """One response to one prompt, with everything the trainer needs per token.

    Invariant: `loss_mask`, `rollout_logprobs` and `versions` (and `behavior_logprobs` when set) have
    one entry per response token. `rollout_logprobs` are the engine's full-vocabulary log-probs;
    `behavior_logprobs` those under the top-k/top-p truncated distribution actually sampled from
    (None when no filter applied: then both are the same).
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float | None = None
    reward_info: dict[str, Any] = field(default_factory=dict)
    status: Status = Status.COMPLETED
    error: str | None = None
    group_id: int = 0
    index: int = 0
    row: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt_text: str = ""
    response_text: str = ""
    behavior_logprobs: list[float] | None = None
    vision: VisionInputs | None = None
    """The prompt's pixel inputs (a vision-language prompt with images), shared by a group's samples."""
    routed_experts: Any = None
    """With `algo.routing_replay` (a mixture-of-experts model): a tensor ``[tokens, layers, k]`` of
    the experts the engine's routers picked for the first ``tokens`` of prompt + response (every
    token the engine ran: all but the last), uint8 or int16 (`weir.data.moe_routing`); the trainer
    replays them. None: not recorded (the trainer's own routers choose)."""

    def __post_init__(self) -> None:
        self.vision = VisionInputs.coerce(self.vision)
        n = len(self.response_ids)
        if not self.loss_mask:
            self.loss_mask = [1] * n
        if not self.rollout_logprobs:
            self.rollout_logprobs = [0.0] * n
        if not self.versions:
            self.versions = [-1] * n
        self.check()

    def check(self) -> None:
        """Raise ValueError if the per-token lists disagree in length with `response_ids`."""
        n = len(self.response_ids)
        names = ["loss_mask", "rollout_logprobs", "versions"]
        if self.behavior_logprobs is not None:
            names.append("behavior_logprobs")
        for name in names:
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Sample.{name} has {len(getattr(self, name))} entries but response_ids has {n}; "
                    "each response token needs exactly one entry"
                )
        routed = self.routed_experts
        if routed is not None and not 0 < routed.shape[0] <= self.num_tokens:
            raise ValueError(
                f"Sample.routed_experts covers {routed.shape[0]} tokens of a sequence of "
                f"{self.num_tokens}; it must cover a prefix of prompt + response"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_trained_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def ok(self) -> bool:
        return self.status != Status.FAILED and self.reward is not None


@dataclass
class Group:
    """The `n` samples of one prompt; group-relative advantages are computed over it."""

    samples: list[Sample]
    group_id: int = 0
    row: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self):
        return iter(self.samples)

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.samples]
