"""What the actor reads from a run's config: its `train` and `algo` sections plus the numbers
derived from others (temperature, total optimizer steps, the longest response)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from weir import algo
from weir.config import Config
from weir.config.schema import AlgoConfig, CorrectionConfig, KLConfig, TrainConfig


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


def kl_controller(kl: KLConfig) -> algo.AdaptiveKLController | algo.FixedKLController:
    """The KL coefficient's controller: adaptive toward `kl.adaptive_target` if set, else fixed."""
    if kl.adaptive_target is not None:
        return algo.AdaptiveKLController(kl.coef, kl.adaptive_target, kl.adaptive_horizon)
    return algo.FixedKLController(kl.coef)


def zero_gradient_rows(
    acfg: AlgoConfig, distills_in_loss: bool, mask: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor | None:
    """(B,) True for rows whose gradient is exactly zero, or None when that cannot be known.

    Every built-in policy loss is the advantage times a function of the log-probs, per token
    (per sequence for GSPO), so a row whose trained tokens all have A = 0 (a GRPO group with
    equal rewards, a masked-out sample) adds exactly 0 to the gradient unless an entropy bonus
    or a KL term in the loss depends on its log-probs. Such rows take no backward, and no
    forward either unless `train.dead_rows=forward` asks for metrics over every row. A user's
    loss (a dotted path) may depend on more, so with one every row trains. `distills_in_loss`:
    a teacher whose term is in the loss (`algo.distill.mode=loss`) trains every row too.
    """
    if (
        acfg.entropy_coef != 0
        or (acfg.kl.coef > 0 and not acfg.kl.as_reward)
        or distills_in_loss
        or not isinstance(acfg.policy_loss, str)
        or acfg.policy_loss not in algo.POLICY_LOSSES
    ):
        return None
    return ~((advantages != 0) & (mask > 0)).any(1)
