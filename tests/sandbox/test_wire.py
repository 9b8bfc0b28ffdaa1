"""The wire between the judge and the program: plain values round-trip exactly, and nothing that
comes over it decodes to anything but builtin plain values."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.sandbox import wire

PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray, list, tuple, dict)
PLAIN_TYPES += (set, frozenset)

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**300), max_value=2**300)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.complex_numbers(allow_nan=False)
    | st.text()  # lone surrogates included
    | st.binary()
    | st.binary().map(bytearray)
)
hashables = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text() | st.binary(),
    lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3),
    max_leaves=6,
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(hashables, inner, max_size=4)
        | st.sets(hashables, max_size=4)
        | st.frozensets(hashables, max_size=4)
    ),
    max_leaves=12,
)


def _same(a, b) -> bool:
    """Equal with the same types all the way down (nan equal to nan, -0.0 apart from 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, complex):
        return _same(a.real, b.real) and _same(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


@given(values)
@settings(max_examples=100, deadline=None)
def test_plain_values_round_trip_exactly(value):
    line = wire.dumps(value)
    assert line.isascii() and "\n" not in line
    assert _same(wire.loads(line), value)


def _only_plain(v) -> bool:
    if type(v) not in PLAIN_TYPES:
        return False
    if isinstance(v, dict):
        return all(_only_plain(k) and _only_plain(x) for k, x in v.items())
    if isinstance(v, (list, tuple, set, frozenset)):
        return all(_only_plain(x) for x in v)
    return True


json_objects = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["$t", "$d", "$s", "$fs", "$b", "$ba", "$f", "$i", "$c", "x"]),
            inner,
            max_size=2,
        )
    ),
    max_leaves=10,
)


@given(json_objects)
@settings(max_examples=150, deadline=None)
def test_whatever_arrives_decodes_to_plain_builtin_values_or_is_refused(obj):
    try:
        value = wire.from_wire(obj)
    except ValueError:
        return
    assert _only_plain(value)


class AlwaysEqual:
    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0


class EqualInt(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def test_only_plain_data_leaves_a_process():
    for value in (AlwaysEqual(), [1, AlwaysEqual()], {AlwaysEqual(): 1}, print, iter([1]), object):
        with pytest.raises(wire.Unencodable):
            wire.dumps(value)
    # a subclass of a plain type leaves as its base type's value: its own __eq__ stays behind
    out = wire.loads(wire.dumps(EqualInt(3)))
    assert type(out) is int and out == 3 and out != 4
    deep: list = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(wire.Unencodable):
        wire.dumps(deep)


def test_malformed_lines_are_refused():
    for line in (
        '{"$t": 1}',
        '{"a": 1}',
        '{"$d": [[[1], 2]]}',
        "NaN",
        "[1] 2",
        '{"$f": "1.5"}',
        '{"$c": [true, 1]}',
        '{"$t": [], "$s": []}',
        "[" * 5000 + "]" * 5000,
    ):
        with pytest.raises(ValueError):
            wire.loads(line)
    assert wire.loads(json.dumps([1, "a", None])) == [1, "a", None]
