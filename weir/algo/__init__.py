"""weir.algo: the algorithm math of weir, as pure tensor functions.

Imports torch only. Tensors are (batch, response_tokens) with a response mask
(1 = trained token, 0 = padding / tool output / observation); rewards are one per
sample with a group id. Every formula is written in its function's docstring;
docs/algorithms.md compares them with verl, OpenRLHF and TRL.

Typical step::

    adv = compute_advantages("grpo", rewards, mask, group_ids)
    corr = rollout_correction(old_logp, rollout_logp, adv.mask, mode="token_tis")
    num_tokens, num_seqs = corr.mask.sum(), corr.mask.any(1).sum()   # whole batch
    for mb in micro_batches:                                            # rows of the batch
        loss, metrics = compute_policy_loss(
            "ppo", logp[mb], old_logp[mb], adv.advantages[mb], corr.mask[mb],
            agg="token-mean", num_tokens=num_tokens, num_seqs=num_seqs,
            weights=corr.weights[mb], eps_high=0.28,
        )
        loss.backward()
"""

from .advantages import ADVANTAGES, AdvantageResult, compute_advantages, masked_whiten
from .aggregation import AGG_MODES, aggregate_loss
from .correction import CORRECTION_MODES, CorrectionResult, rollout_correction
from .correction_presets import (
    CORRECTION_PRESETS,
    RECOMMENDABLE,
    mismatch_diagnostics,
    preset_settings,
    recommend_preset,
)
from .distill import reverse_kl, reverse_kl_advantages, reverse_kl_loss
from .entropy import entropy_from_logits, logprobs_from_logits, token_logprobs_and_entropy
from .kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
    kl_token_rewards,
    make_kl_controller,
)
from .policy_loss import POLICY_LOSSES, compute_policy_loss, policy_loss_terms
from .registry import Registry, resolve
from .value_loss import ValueLoss, value_loss

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "CORRECTION_MODES",
    "CORRECTION_PRESETS",
    "RECOMMENDABLE",
    "KL_KINDS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageResult",
    "CorrectionResult",
    "FixedKLController",
    "Registry",
    "aggregate_loss",
    "compute_advantages",
    "compute_policy_loss",
    "entropy_from_logits",
    "kl_penalty",
    "kl_token_rewards",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_whiten",
    "mismatch_diagnostics",
    "policy_loss_terms",
    "preset_settings",
    "recommend_preset",
    "resolve",
    "reverse_kl",
    "reverse_kl_advantages",
    "reverse_kl_loss",
    "rollout_correction",
    "token_logprobs_and_entropy",
    "ValueLoss",
    "value_loss",
]
