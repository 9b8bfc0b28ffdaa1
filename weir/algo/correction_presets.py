"""Named presets of the rollout/trainer mismatch correction, and the diagnostic that picks one.

Each preset is a setting of :func:`weir.algo.rollout_correction` (mode, cap, band, sequence ratio)
with the band its paper recommends; none adds a mechanism of its own. With ``d_t = train_logp_t -
rollout_logp_t`` over a sequence's trained tokens ``t = 1..n`` (clamped to ``[-20, 20]``):

* token ratio ``rho_t = exp(d_t)``;
* sequence ratio ``rho_seq = exp(sum_t d_t)`` (the likelihood ratio of the whole response);
* geometric-mean ratio ``rho_geo = exp(mean_t d_t)`` (its per-token average).

=============== ============ =========================================== ===========================
preset          mode         weight w, mask                              source
=============== ============ =========================================== ===========================
``tis``         token_tis    ``w_t = min(rho_t, 2)``                     Yao et al. 2025 (TIS, C=2)
``seq_tis``     seq_tis      ``w = min(rho_seq, 2)`` on every token      Liu, Li et al. 2025
``geo_tis``     seq_tis      ``w = min(rho_geo, 2)`` on every token      geometric variant of the above
``token_mask``  token_mask   ``w = 1``; tokens with rho_t outside        token rejection (verl's
                             ``[0.5, 2]`` removed                        ``token_rs``, threshold 2)
``icepop``      token_mis    ``w_t = rho_t`` inside ``[0.5, 5]``,        Ling Team 2025 (Ring-1T,
                             tokens outside removed                      IcePop, alpha 0.5, beta 5)
``seq_mask``    seq_mask     ``w = 1``; sequences with rho_seq outside   sequence rejection (verl's
                             ``[0.5, 2]`` removed                        ``seq_rs``, threshold 2)
``seq_mis``     seq_mis      ``w = rho_seq`` for ``rho_seq <= 2``,       Liu, Li et al. 2025
                             sequences above removed                     (sequence MIS, C=2)
``geo_mask``    seq_mask     ``w = 1``; sequences with rho_geo outside   verl's ``geo_rs``
                             ``[0.999, 1.001]`` removed                  (threshold 1.001)
=============== ============ =========================================== ===========================

Yao et al. 2025: "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training".
Liu, Li et al. 2025: "When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch". Ling Team 2025: "Every Step Evolves: Scaling Reinforcement
Learning for Trillion-Scale Thinking Model" (Ring-1T).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ._checks import check_finite_where, check_float_tensor, check_mask, check_shape, sanitize
from .correction import LOG_RATIO_CLAMP
from .registry import suggest

__all__ = [
    "CORRECTION_PRESETS",
    "CorrectionPreset",
    "mismatch_diagnostics",
    "preset_settings",
    "recommend_preset",
]


@dataclass(frozen=True)
class CorrectionPreset:
    """One named setting of `rollout_correction`.

    ``level`` says which ratio the preset tests against its band: ``token`` (rho_t), ``seq``
    (rho_seq) or ``geo`` (rho_geo). For a ``*_tis`` mode the band is ``(0, cap]`` (weights above
    ``cap`` are truncated); otherwise ``[low, high]``."""

    name: str
    mode: str
    level: Literal["token", "seq", "geo"]
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0
    source: str = ""

    @property
    def seq_ratio(self) -> Literal["product", "geometric"]:
        return "geometric" if self.level == "geo" else "product"

    @property
    def band(self) -> tuple[float, float]:
        """The interval of ratios the preset leaves untouched."""
        if self.mode.endswith("_tis"):
            return (0.0, self.cap)
        return (self.low, self.high)


_PRESETS = (
    CorrectionPreset("tis", "token_tis", "token", cap=2.0, source="Yao et al. 2025"),
    CorrectionPreset("seq_tis", "seq_tis", "seq", cap=2.0, source="Liu, Li et al. 2025"),
    CorrectionPreset("geo_tis", "seq_tis", "geo", cap=2.0, source="geometric-mean sequence TIS"),
    CorrectionPreset(
        "token_mask", "token_mask", "token", low=0.5, high=2.0, source="verl token_rs"
    ),
    CorrectionPreset("icepop", "token_mis", "token", low=0.5, high=5.0, source="Ling Team 2025"),
    CorrectionPreset("seq_mask", "seq_mask", "seq", low=0.5, high=2.0, source="verl seq_rs"),
    CorrectionPreset("seq_mis", "seq_mis", "seq", low=0.0, high=2.0, source="Liu, Li et al. 2025"),
    CorrectionPreset("geo_mask", "seq_mask", "geo", low=0.999, high=1.001, source="verl geo_rs"),
)
CORRECTION_PRESETS: dict[str, CorrectionPreset] = {p.name: p for p in _PRESETS}
RECOMMENDABLE = ("none", "tis", "seq_mis", "icepop")
"""What `recommend_preset` may answer; `correction/recommended` is the index in this tuple."""

QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)


def preset_settings(name: str) -> dict[str, object]:
    """The `rollout_correction` keyword arguments of preset `name` (mode, cap, low, high,
    seq_ratio). ValueError naming the valid presets for an unknown name."""
    if name not in CORRECTION_PRESETS:
        raise ValueError(
            f"algo.correction.preset: unknown preset {name!r}; valid: "
            f"{', '.join(CORRECTION_PRESETS)}{suggest(str(name), CORRECTION_PRESETS)}"
        )
    p = CORRECTION_PRESETS[name]
    return {"mode": p.mode, "cap": p.cap, "low": p.low, "high": p.high, "seq_ratio": p.seq_ratio}


def _quantiles(x: Tensor, keep: Tensor) -> Tensor:
    """`QUANTILES` of the entries of the 1-D `x` where `keep` is true, by nearest rank (0 where none
    is kept), computed on `x`'s device without reading anything back (`torch.quantile` refuses
    more than 16M values and wants the count on the host)."""
    s = torch.where(keep, x, torch.full((), float("inf"), dtype=x.dtype, device=x.device)).sort()
    n = keep.sum()
    last = (n - 1).clamp(min=0).double()
    idx = torch.stack([(last * q).round() for q in QUANTILES]).long()
    return torch.where(n > 0, s.values[idx], torch.zeros((), dtype=x.dtype, device=x.device))


def mismatch_diagnostics(
    train_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, validate: bool = True
) -> dict[str, float]:
    """How far the trainer's log-probs are from the engine's, as the presets see it.

    Returns (python floats, over trained tokens / sequences with a trained token):

    * ``token_ratio_q{01,05,50,95,99}``: quantiles of ``rho_t``;
    * ``geo_ratio_q{01,50,99}``: quantiles of the geometric-mean ratio ``rho_geo``;
    * ``seq_logratio_q{01,50,99}``: quantiles of ``log rho_seq = sum_t d_t``;
    * ``max_abs_logratio``: ``max_t |d_t|``;
    * ``outside/<preset>``: for every preset, the share of its units (tokens, or sequences for the
      sequence-level ones) whose ratio falls outside the preset's band, i.e. that it would
      truncate or remove;
    * ``recommended``: the index in `RECOMMENDABLE` of `recommend_preset`'s answer.

    An empty dict when `mask` selects no token. Everything is computed on the inputs' device and read back in one transfer, so a trainer step
    pays one device sync for it. `validate=False` skips the shape and finiteness checks (one more
    sync) for callers that made them already.
    """
    if validate:
        train_logp = check_float_tensor("train_logp", train_logp, ndim=2)
        rollout_logp = check_float_tensor("rollout_logp", rollout_logp, ndim=2)
        mask = check_mask("mask", mask, train_logp.shape)
        check_shape("rollout_logp", rollout_logp, train_logp.shape, "same as train_logp")
        check_finite_where({"train_logp": train_logp, "rollout_logp": rollout_logp}, mask)
    m = mask.bool()
    with torch.no_grad():
        dtype = torch.promote_types(train_logp.dtype, torch.float32)
        d = sanitize(train_logp.detach().to(dtype) - rollout_logp.detach().to(dtype), m)
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        n_b = m.sum(1)
        has = n_b > 0
        seq_log = d.sum(1)
        geo_log = seq_log / n_b.clamp(min=1).to(dtype)
        ratios = {
            "token": (torch.exp(d).flatten(), m.flatten()),
            "seq": (torch.exp(seq_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), has),
            "geo": (torch.exp(geo_log), has),
        }
        names: list[str] = [f"token_ratio_q{round(q * 100):02d}" for q in QUANTILES]
        parts: list[Tensor] = [_quantiles(*ratios["token"])]
        geo_q, seq_q = _quantiles(*ratios["geo"]), _quantiles(seq_log, has)
        for i in (0, 2, 4):  # q01, q50, q99
            tag = f"q{round(QUANTILES[i] * 100):02d}"
            names += [f"geo_ratio_{tag}", f"seq_logratio_{tag}"]
            parts.append(torch.stack([geo_q[i], seq_q[i]]))
        names.append("max_abs_logratio")
        parts.append(d.abs().max().reshape(1))
        for p in _PRESETS:
            r, keep = ratios[p.level]
            lo, hi = p.band
            outside = (((r < lo) | (r > hi)) & keep).sum().to(dtype) / keep.sum().clamp(min=1)
            names.append(f"outside/{p.name}")
            parts.append(outside.reshape(1))
        parts.append(m.sum().reshape(1))
        *values, count = torch.cat([t.to(dtype) for t in parts]).tolist()
    if not count:
        return {}
    out = dict(zip(names, values, strict=True))
    out["recommended"] = float(RECOMMENDABLE.index(recommend_preset(out)))
    return out


def recommend_preset(diag: dict[str, float]) -> str:
    """The preset a run with these `mismatch_diagnostics` needs (a rule of thumb, in this order):

    1. ``none`` when no token's ratio is off by more than 0.1% (``max |d_t| <= 1e-3``): the engine
       computes the trainer's numbers (weir's torch engine in float32); a correction would only
       add variance.
    2. ``icepop`` when more than 0.1% of tokens have a ratio outside ``[0.5, 2]``: single tokens far
       off (a mixture-of-experts router that flips experts, fp8 rollouts). Truncated weights would
       still train on them; IcePop removes them.
    3. ``seq_mis`` when more than 5% of sequences have a likelihood ratio above 2 or below 0.5 while
       their tokens are close: small per-token errors that add up over long responses. Sequence
       MIS rejects the sequences whose ratio is above 2 and weighs the rest exactly.
    4. ``tis`` otherwise: a small, spread-out mismatch (bf16 engine, fp32 trainer), which token TIS
       with cap 2 corrects at low variance (Yao et al. 2025).
    """
    if diag["max_abs_logratio"] <= 1e-3:
        return "none"
    if diag["outside/token_mask"] > 1e-3:
        return "icepop"
    if diag["outside/seq_mask"] > 0.05:
        return "seq_mis"
    return "tis"
