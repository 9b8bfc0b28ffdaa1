"""Which sequences of one prefill share a prefix worth computing once.

A prefill that rebuilds the KV of the rows in flight after a weight update (`weir.engine.admission`)
holds every sample of a prompt, and in agentic RL every prompt of a batch may open with the same
system message and tool list: run as they are, the shared tokens are computed once per row. Computed
in two forwards instead (the shared prefixes once, then each row's remainder attending to its
prefix's keys and values, `weir.engine.prefix_cache.fill_past`), they cost

    groups * longest_prefix + rows * max_i(len_i - prefix_i)

padded tokens against ``rows * max_i(len_i)`` in one forward (both forwards pad their rows to the
longest). `plan` sorts the sequences, so that those sharing a prefix are neighbours whose common
prefix is the shortest neighbour-to-neighbour one among them, and tries every cut of that order at a
common-prefix length: the cheapest plan wins, if it saves enough.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SharedPlan", "plan"]


@dataclass(frozen=True)
class SharedPlan:
    """`group[i]`: the prefix sequence `i` takes (-1: none); `lengths[g]`: prefix `g`'s length;
    `first[g]`: a sequence that starts with prefix `g`. `cost`: padded tokens of both forwards."""

    group: list[int]
    lengths: list[int]
    first: list[int]
    cost: int


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of `a` and `b`: a binary search over slice comparisons, which run
    in C (a Python loop over the tokens would hold the engine thread for a long shared prompt)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan(seqs: Sequence[Sequence[int]], min_saving: float = 0.15) -> SharedPlan | None:
    """The cheapest way to share prefixes among `seqs`, or None when it saves less than
    `min_saving` of the one-forward cost (or no two sequences share a token).

    Every shared prefix leaves at least one token of each of its sequences to compute, so that the
    second forward has a query for every row.
    """
    n = len(seqs)
    if n < 2:
        return None
    lens = [len(s) for s in seqs]
    plain = n * max(lens)
    seqs = [list(x) for x in seqs]
    order = sorted(range(n), key=seqs.__getitem__)
    adjacent = [_common(seqs[order[k - 1]], seqs[order[k]]) for k in range(1, n)]
    best: SharedPlan | None = None
    for cut in sorted({a for a in adjacent if a > 0}):
        group = [-1] * n
        lengths: list[int] = []
        first: list[int] = []
        k = 0
        while k < n:
            end = k + 1
            shared = lens[order[k]] - 1
            while end < n and adjacent[end - 1] >= cut:
                shared = min(shared, adjacent[end - 1], lens[order[end]] - 1)
                end += 1
            if end - k > 1 and shared > 0:
                for j in range(k, end):
                    group[order[j]] = len(lengths)
                lengths.append(shared)
                first.append(order[k])
            k = end
        if not lengths:
            continue
        rest = max(lens[i] - (lengths[g] if g >= 0 else 0) for i, g in enumerate(group))
        cost = len(lengths) * max(lengths) + n * rest
        if best is None or cost < best.cost:
            best = SharedPlan(group, lengths, first, cost)
    if best is None or best.cost > (1.0 - min_saving) * plain:
        return None
    return best
