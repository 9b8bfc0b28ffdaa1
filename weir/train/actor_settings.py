"""What the actor reads from a run's config: its `train` and `algo` sections plus the numbers
derived from others (temperature, total optimizer steps, the longest response)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from weir import algo
from weir.config import Config
from weir.config.schema import AlgoConfig, CorrectionConfig, TrainConfig


@dataclass(frozen=True)
class ActorSettings:
    """What the actor reads from a run's config: its own sections plus three derived numbers.

    temperature: the sampling temperature T; log-probs are ``log_softmax(logits / T)`` as the
        engine reports them.
    total_steps: optimizer steps of the whole run (for the learning-rate schedule).
    max_response_tokens: the most response tokens one sample can have, the constant normaliser
        of Dr.GRPO's ``seq-mean-token-sum-norm``: ``rollout.max_new_tokens`` for one turn,
        ``agent.max_tokens`` for multi-turn episodes (all turns and observations together).
        ``algo.loss_options.max_len`` overrides it.
    """

    train: TrainConfig
    algo: AlgoConfig
    temperature: float = 1.0
    total_steps: int = 1
    max_response_tokens: int = 256
    teacher: str | None = None
    """`algo.distill.teacher` with a `tiny:` model resolved to its directory (`weir.train.teacher`)."""

    @property
    def needs_reference(self) -> bool:
        """Whether the actor keeps a frozen copy of the initial policy: for the KL term, or as the
        distillation teacher."""
        return self.algo.kl.coef > 0 or self.teacher == "reference"

    @classmethod
    def from_config(cls, cfg: Config) -> ActorSettings:
        multi_turn = cfg.agent.env is not None or "multi_turn" in cfg.rollout.function
        longest = cfg.agent.max_tokens if multi_turn else cfg.rollout.max_new_tokens
        if cfg.multi_agent.roles:  # one role's view: its turns and the others' shown to it
            longest = cfg.multi_agent.max_tokens
        return cls(
            train=cfg.train,
            algo=cfg.algo,
            temperature=cfg.rollout.temperature or 1.0,
            total_steps=max(1, policy_steps(cfg) * cfg.train.mini_batches * cfg.train.epochs),
            max_response_tokens=longest,
            teacher=cfg.algo.distill.teacher,
        )


def policy_steps(cfg: Config) -> int:
    """RL steps that update the policy: all but the critic's warm-up (critic.freeze_actor_steps)."""
    frozen = cfg.critic.freeze_actor_steps if cfg.algo.advantage == "gae" else 0
    return max(0, cfg.run.steps - frozen)


def check_algo_options(
    acfg: AlgoConfig,
    advantage_fn: Callable,
    loss_fn: Callable,
    max_len: int,
    loss_options: dict[str, Any],
) -> None:
    """Run the advantage and policy-loss functions once on a two-token probe, so that a misspelt or
    invalid `algo` option fails at start-up, not after the first rollout."""
    ones = torch.ones(2, 1)
    probe = torch.full((2, 1), -1.0)
    values = {"values": torch.zeros(2, 1)} if acfg.advantage == "gae" else {}
    adv = algo.compute_advantages(
        advantage_fn,
        torch.tensor([1.0, 0.0]),
        ones,
        torch.tensor([0, 0]),
        **values,
        **acfg.advantage_options,
    )
    algo.compute_policy_loss(
        loss_fn,
        probe,
        probe,
        adv.advantages,
        ones,
        agg=acfg.loss_agg,
        num_tokens=2.0,
        num_seqs=2.0,
        max_len=max_len,
        behavior_logp=probe if acfg.policy_loss == "decoupled_ppo" else None,
        **loss_options,
    )


CORRECTION_KEYS = ("mode", "cap", "low", "high", "seq_ratio")


def correction_settings(c: CorrectionConfig) -> dict[str, Any]:
    """`algo.correction` as `weir.algo.rollout_correction`'s keyword arguments: the section's values,
    overridden by its preset's (`weir.algo.correction_presets`), overridden in turn by the keys the
    user set explicitly."""
    out = {k: getattr(c, k) for k in CORRECTION_KEYS}
    if c.preset is not None:
        out.update(algo.preset_settings(c.preset))
        out.update({k: getattr(c, k) for k in CORRECTION_KEYS if k in c.model_fields_set})
    return out
