"""Dealing a batch's rows to trainer ranks by whole prompt groups (the `prefix` layout on ranks)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from weir.train.deal import balance, deal_groups


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.lists(st.integers(1, 9), min_size=1, max_size=5)),
        min_size=1,
        max_size=7,
    ),
    st.integers(1, 4),
)
def test_every_row_goes_to_one_rank_with_its_whole_group(shapes, ranks):
    seqs, lens, group_of = [], [], []
    for g, (p, responses) in enumerate(shapes):
        prompt = [100 + g] * p  # distinct prompts
        for n in responses:
            seqs.append(prompt + [7] * n)
            lens.append(n)
            group_of.append(g)
    rows = list(range(len(seqs)))
    bins = deal_groups(rows, seqs, lens, ranks)
    assert len(bins) == ranks
    assert sorted(i for b in bins for i in b) == rows
    assert all(b == sorted(b) for b in bins)
    for g in set(group_of):
        members = {i for i in rows if group_of[i] == g}
        assert sum(bool(members & set(b)) for b in bins) == 1  # one rank holds the whole group
    assert deal_groups(rows, seqs, lens, ranks) == bins  # the same on every rank
    # the heaviest rank exceeds the lightest by at most the largest group's tokens
    size = {g: shapes[g][0] + sum(shapes[g][1]) for g in set(group_of)}
    loads = [sum(size[g] for g in {group_of[i] for i in b}) for b in bins]
    assert max(loads) - min(loads) <= max(size.values())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4096), min_size=1, max_size=60), st.integers(1, 8))
def test_packed_rows_are_dealt_by_tokens_not_by_count(lengths, ranks):
    """The `varlen` (and `padded`) layouts deal rows to ranks by tokens: the heaviest rank holds
    at most one sequence more than the lightest, in tokens, whatever the rows per rank."""
    bins = balance(lengths, ranks)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= max(lengths)
    assert balance(lengths, ranks) == bins
