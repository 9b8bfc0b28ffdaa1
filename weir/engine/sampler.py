"""Drawing the next token of every row of the running batch, with tensor ops only.

Each row inverts the CDF of ``softmax(logits / T)`` at its own uniform (`weir.engine.streams`), so a
draw depends only on the row's logits, key and token index. Top-k / top-p rows draw from their
sorted, truncated distribution (top-k first, then top-p on the renormalised top-k mass, as HF and
vLLM do). The reported log-prob is always the full-vocabulary ``log_softmax(logits / T)[token]``
(`weir.engine.base`); for filtered rows the log of the probability mass the filters kept is returned
too, so that ``logprob - log_kept`` is the log-prob under the distribution actually sampled from.
"""

from __future__ import annotations

import torch

from weir.engine.slabs import Rows
from weir.engine.streams import stream_uniform

__all__ = ["sample", "sample_filtered"]


def sample(
    b: Rows, logits: torch.Tensor, vocab_col: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Tokens, their full-vocabulary log-probs ``log_softmax(logits / T)[tok]`` and, when some row
    is filtered, the log of the mass top-k/top-p kept per row (0 for unfiltered rows). `logits` is
    scaled in place; `vocab_col` is ``arange(vocab_size)`` on the logits' device."""
    vocab_size = logits.shape[1]
    if b.all_greedy:
        tok = logits.argmax(1)
        lse = torch.logsumexp(logits, 1)
        return tok, logits.gather(1, tok.unsqueeze(1)).squeeze(1).sub_(lse), None
    scaled = logits.mul_(b.inv_t.unsqueeze(1))
    lse = torch.logsumexp(scaled, 1, keepdim=True)
    u = stream_uniform(b.key, b.ngen)
    cdf = (scaled - lse).exp_().cumsum_(1)
    tok = torch.searchsorted(cdf, u.unsqueeze(1).mul_(cdf[:, -1:])).squeeze(1)
    tok.clamp_(max=vocab_size - 1)
    lz = None
    if b.filt_idx is not None:
        f = b.filt_idx
        lz = torch.zeros_like(u)
        tok[f], lz[f] = sample_filtered(
            scaled.index_select(0, f),
            lse.index_select(0, f),
            u.index_select(0, f),
            b.top_k.index_select(0, f),
            b.top_p.index_select(0, f),
            vocab_col,
        )
    if b.greedy_idx is not None:
        g = b.greedy_idx
        tok[g] = scaled.index_select(0, g).argmax(1)  # inv_t is 1 for greedy rows
    lp = scaled.gather(1, tok.unsqueeze(1)).sub_(lse).squeeze(1)
    return tok, lp, lz


def sample_filtered(
    scaled: torch.Tensor,
    lse: torch.Tensor,
    u: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    vocab_col: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens drawn from the top-k / top-p truncated, renormalised distribution, and the log of the
    probability mass the truncation kept, ``log sum_{v in kept} p_v``."""
    values, order = scaled.sort(dim=1, descending=True, stable=True)
    probs = (values - lse).exp_()
    probs.mul_(vocab_col.unsqueeze(0) < top_k.unsqueeze(1))  # top-k
    cum = probs.cumsum(1)
    # top-p on the (renormalised) top-k mass: keep a token while the mass before it is < p.
    probs.mul_((cum - probs) < top_p.unsqueeze(1) * cum[:, -1:])
    cdf = probs.cumsum_(1)
    j = torch.searchsorted(cdf, u.unsqueeze(1).mul_(cdf[:, -1:]))
    j.clamp_(max=scaled.shape[1] - 1)
    return order.gather(1, j).squeeze(1), cdf[:, -1].log()
