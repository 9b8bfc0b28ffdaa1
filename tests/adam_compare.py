"""Comparing the weights of two runs of the same AdamW step without depending on a CPU's rounding.

AdamW moves a weight by ``lr * m_hat / (sqrt(v_hat) + eps)`` (plus the same weight decay on both).
Where ``sqrt(v_hat)`` is near eps (a gradient of ~1e-8), a rounding-sized difference between the two
runs' gradients (another summation order: another thread count, device, or rank layout) moves that
step by up to its whole size, so those weights are not comparable; everywhere else the step is a
smooth function of the gradients. So: weights must agree where ``sqrt(v_hat) >= 1e3 * eps`` or is 0
(every gradient exactly 0, as for the embedding rows of unseen tokens: no step at all), and the
others are counted (a bounded share, so that the check keeps its bite) and each bounded by what two
steps can differ by.

On the first step ``m_hat = g`` and ``sqrt(v_hat) = |g|``: the step is ``lr * g / (|g| + eps)``, whose
sensitivity ``lr * eps / (|g| + eps)^2`` at ``|g| >= T = 1e3 * eps`` turns a gradient difference of
1e-6 into at most ``lr * 1e-6 / (1e6 * eps) = lr * 1e-4`` (1e-7 at lr 1e-3), under the 1e-6 asked,
with float32's rounding of |w| <= 2 (2.4e-7) on top.
"""

from __future__ import annotations

import torch

ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which the actor uses
WELL_ABOVE = 1e3 * ADAM_EPS


def adam_denominators(optimizer: torch.optim.Optimizer, params) -> torch.Tensor:
    """``sqrt(v_hat)`` of each element of `params` (flattened, in order) after the last step."""
    out = []
    for p in params:
        state = optimizer.state[p]
        beta2 = next(
            g["betas"][1] for g in optimizer.param_groups if any(q is p for q in g["params"])
        )
        step = float(state["step"])
        v_hat = state["exp_avg_sq"].detach().to("cpu").reshape(-1) / (1 - beta2**step)
        out.append(v_hat.sqrt())
    return torch.cat(out)


def assert_adamw_weights_agree(
    w1: torch.Tensor,
    w2: torch.Tensor,
    denominators: torch.Tensor,
    *,
    lr: float,
    atol: float = 1e-6,
    max_rest: float = 0.15,
    max_step: float = 2.0,
) -> int:
    """`w1`, `w2`: the weights (flattened) after the same AdamW step(s) in two runs; `denominators`:
    ``sqrt(v_hat)`` per weight (on the first step, the smaller |g| of the two runs). Weights agree
    within `atol` where the denominator is at least `WELL_ABOVE` or exactly 0; the others, fewer than `max_rest`
    of all, differ by at most twice a step (``max_step * lr`` bounds one). Returns their number."""
    assert w1.shape == w2.shape == denominators.shape
    assert w1.abs().max() <= 2.0  # the float32 rounding the bound allows for
    well_above = (denominators >= WELL_ABOVE) | (denominators == 0)
    diff = (w2 - w1).abs()
    if well_above.any():
        worst = int(diff.masked_fill(~well_above, 0).argmax())
        assert diff[worst] < atol, (
            f"weight {worst} differs by {diff[worst]:.3g} where sqrt(v_hat) = "
            f"{denominators[worst]:.3g}"
        )
    rest = int((~well_above).sum())
    assert rest < max_rest * w1.numel(), f"{rest} of {w1.numel()} weights: 0 < sqrt(v_hat) < 1e-5"
    if rest:
        assert diff[~well_above].max() <= 2 * max_step * lr + atol
    return rest
