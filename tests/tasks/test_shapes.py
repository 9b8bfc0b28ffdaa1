"""The shapes task: answers checked against the pixels, determinism, disjoint splits, corruption."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.data.vision import load_image
from weir.tasks import get_task
from weir.tasks.shapes import COLOURS, SIDE, draw, make_rows, sft_rows

GREY = (128, 128, 128)


def _read(img) -> tuple[int, str]:
    """Count and colour read off the pixels: shapes sit one per quadrant."""
    px = img.load()
    half = SIDE // 2
    quads = {(x // half, y // half) for x in range(SIDE) for y in range(SIDE) if px[x, y] != GREY}
    colours = Counter(px[x, y] for x in range(SIDE) for y in range(SIDE) if px[x, y] != GREY)
    ((rgb, _),) = colours.most_common(1)
    return len(quads), next(name for name, c in COLOURS.items() if c == rgb)


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=0, max_value=2**40))
def test_answers_match_the_pixels(seed):
    img, count, colour = draw(seed)
    assert img.size == (SIDE, SIDE)
    assert _read(img) == (count, colour)


def test_rows_are_deterministic_and_splits_disjoint():
    a = make_rows("train", 20, seed=3)
    assert a == make_rows("train", 20, seed=3)
    test = make_rows("test", 50, seed=3)
    assert not {r["image_seed"] for r in make_rows("train", 200, seed=3)} & {
        r["image_seed"] for r in test
    }
    assert [r["question"] for r in a[:4]] == ["count", "colour", "count", "colour"]
    for r in a:
        count, colour = _read(load_image(r["images"][0]))
        assert r["answer"] == (str(count) if r["question"] == "count" else colour)
    assert {r["question"] for r in make_rows("test", 6, 0, questions="colour")} == {"colour"}
    with pytest.raises(ValueError, match="subset"):
        make_rows("train", 2, 0, questions="size")


def test_sft_corruption_is_exact_and_systematic():
    rows = sft_rows(200, seed=1, corrupt=0.7)
    bad = [r for r in rows if r["corrupted"]]
    assert len(bad) == 140
    assert all(r["response"] == r["answer"] for r in rows if not r["corrupted"])
    # one fixed wrong answer per true answer: the next one in the cycle, worked out by hand
    following = {"1": "2", "2": "3", "3": "4", "4": "1"}
    following |= {"blue": "green", "green": "red", "red": "yellow", "yellow": "blue"}
    assert all(r["response"] == following[r["answer"]] for r in bad)
    assert {r["question"] for r in bad} == {"count", "colour"}
    assert {r["answer"] for r in bad} == set(following)
    assert get_task("shapes").reward == "exact_match"
    with pytest.raises(ValueError, match="corrupt"):
        sft_rows(4, seed=0, corrupt=1.5)
