"""How a batch's rows are dealt to data-parallel trainer ranks: by tokens (`balance`), or by
whole prompt groups (`deal_groups`, for the `prefix` layout, which runs each prompt once)."""

from __future__ import annotations

from weir.train.packing import prompt_groups


def balance(lengths: list[int], ranks: int) -> list[list[int]]:
    """Deal positions to `ranks` bins, longest first into the bin with the fewest tokens so far.

    Deterministic (ties go to the lower rank, equal lengths keep their order); each bin is
    returned in increasing position order.
    """
    bins: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for pos in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        bins[r].append(pos)
        load[r] += lengths[pos]
    return [sorted(b) for b in bins]


def deal_groups(
    indices: list[int], seqs: list[list[int]], lens: list[int], ranks: int
) -> list[list[int]]:
    """Rows `indices` dealt to `ranks` bins by prompt group (rows with the same prompt stay
    together), the group of most tokens first into the bin with the fewest so far; each bin in
    increasing row order. Deterministic, so every rank computes the same deal."""
    units = list(prompt_groups(seqs, lens, indices).values())
    sizes = [len(seqs[u[0]]) - lens[u[0]] + sum(lens[i] for i in u) for u in units]
    dealt = balance(sizes, ranks)
    return [sorted(i for k in b for i in units[k]) for b in dealt]
