"""How far a bfloat16 gradient of the log-prob / entropy head is from the exact one, in units of
what rounding allows (shared by the CPU and GPU tests of the fused head).

For bf16 logits x, upstream weights (w_lp, w_H) and temperature T, the exact gradient of
``sum(w_lp logp + w_H H)`` (in float64, from the same bf16 logits) is ``g* = a + b`` with

    a = w_lp (onehot(id) - p) / T,      b = -w_H p (log p + H) / T.

The fused head sums a and b in float32 and rounds once: |g - g*| <= ulp(g*) / 2, up to float32
arithmetic. The reference rounds a and b to bf16 apart and adds them in bf16: three roundings,
ulp(a)/2 + ulp(b)/2 + ulp(g*)/2. Where a and b nearly cancel, three roundings are far more than
one ulp of the small result (so a relative tolerance on the result cannot hold); where log p and
H nearly cancel inside b, float32's error in H (a sum over the vocabulary) is amplified. Both are
covered by the float32 allowance ``2^-16 (|a| + |w_H| p (|log p| + H) / T)``, relative to the
terms before they cancel (float32 carries 2^-24; 2^-16 leaves room for the vocabulary-long sums),
and ``2^-133`` (bf16's smallest subnormal) below which bf16 holds nothing.
"""

from __future__ import annotations

import torch

BF16_TINY = 2.0**-133
FLOAT32_SLACK = 2.0**-16


def half_ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """Half a bfloat16 unit in the last place at |x| (8 significant bits)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.exp2(e - 8)


def excess(
    grads: dict[str, torch.Tensor],
    x: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    t: float,
    entropy_trained: bool,
    rows: int = 512,
) -> dict[str, dict[str, float]]:
    """For each gradient of `grads` (bf16, the shape of `x`), over all elements: the largest
    |g - g*| divided by the one-rounding bound (``one``, <= 1 for the fused head) and by the
    three-rounding bound (``three``, <= 1 for the reference), and the mean |g - g*| (``mean``).
    Computed `rows` rows at a time in float64 on `x`'s device."""
    out = {k: {"one": 0.0, "three": 0.0, "sum": 0.0} for k in grads}
    w_lp, w_h = (
        w[0].double(),
        (w[1].double() if entropy_trained else torch.zeros_like(w[0]).double()),
    )
    for s in range(0, x.shape[0], rows):
        z = x[s : s + rows].double() / t
        logp = z - torch.logsumexp(z, -1, keepdim=True)
        p = logp.exp()
        plogp = torch.where(p == 0, 0.0, p * logp)
        h = -plogp.sum(-1, keepdim=True)
        onehot = torch.zeros_like(p).scatter_(1, ids[s : s + rows, None], 1.0)
        a = w_lp[s : s + rows, None] * (onehot - p) / t
        wh = w_h[s : s + rows, None]
        b = -wh * torch.where(p == 0, 0.0, p * (logp + h)) / t
        exact = a + b
        b_terms = wh.abs() * torch.where(p == 0, 0.0, p * (logp.abs() + h)) / t
        slack = FLOAT32_SLACK * (a.abs() + b_terms) + BF16_TINY
        one = half_ulp_bf16(exact) + slack
        three = half_ulp_bf16(a) + half_ulp_bf16(b) + one
        for k, g in grads.items():
            err = (g[s : s + rows].double() - exact).abs()
            assert not err.isnan().any(), k
            out[k]["one"] = max(out[k]["one"], float((err / one).max()))
            out[k]["three"] = max(out[k]["three"], float((err / three).max()))
            out[k]["sum"] += float(err.sum())
    return {
        k: {"one": v["one"], "three": v["three"], "mean": v["sum"] / x.numel()}
        for k, v in out.items()
    }


NON_FINITE_ROWS = (1, 2, 3, 4, 6)
"""The rows `make_non_finite` changes; the others stay finite."""


def make_non_finite(logits: torch.Tensor, ids: torch.Tensor) -> None:
    """In place, the non-finite cases the fused head must answer as the reference does (needs at
    least 7 rows and 41 columns): row 1 all -inf (logp and H NaN), a +inf in row 2 (logp -inf,
    H NaN), a NaN in row 3 (all NaN), a +inf at row 4's token (logp NaN: inf - inf), a -inf at
    row 6's token (logp -inf)."""
    logits[1] = float("-inf")
    logits[2, 20] = float("inf")
    logits[3, 30] = float("nan")
    logits[4, 40] = float("inf")
    ids[4] = 40
    logits[6, 12] = float("-inf")
    ids[6] = 12
