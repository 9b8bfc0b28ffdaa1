"""Plain values across the process boundary between the judge and the program it judges.

A tagged JSON encoding that round-trips exactly: ``None``, ``bool``, ``int`` (any size), ``float``
(``nan``, ``inf`` and ``-0.0`` included), ``complex``, ``str`` (lone surrogates included), ``bytes``,
``bytearray``, ``list``, ``tuple``, ``dict`` (any hashable keys, in order), ``set`` and
``frozenset``, nested. JSON strings, numbers, booleans, null and arrays stand for themselves (an
array is a list); every other value is a JSON object with one key naming its type::

    (1, 2)        -> {"$t": [1, 2]}          {1: "a"}      -> {"$d": [[1, "a"]]}
    {1, 2}        -> {"$s": [1, 2]}          frozenset()   -> {"$fs": []}
    b"\\x00"       -> {"$b": "00"}            bytearray(b"") -> {"$ba": ""}
    float("nan")  -> {"$f": "nan"}           1j            -> {"$c": [0.0, 1.0]}
    2 ** 70       -> {"$i": "0x400000000000000000000"}

Decoding builds only those builtin types, so nothing the sending side defines (a class whose
``__eq__`` always returns True, a function, a pickled object) can come out of `loads` on the
receiving side: the judge compares values it built itself. `dumps` refuses anything else with
`Unencodable` (a subclass of a builtin type is sent as its base type's value).

This module is stdlib-only and self-contained: its source is put verbatim into the sandboxed
program's launcher and into the judge, which may run under another interpreter than weir's.
"""

_INT_MAX = 1 << 63
_DEPTH = 100


class Unencodable(TypeError):
    """A value that is not plain data (or nests deeper than the wire allows)."""


def to_wire(value, depth=0):
    """`value` as a JSON-ready object in the tagged encoding; Unencodable if it is not plain."""
    if depth > _DEPTH:
        raise Unencodable(f"nested deeper than {_DEPTH} levels")
    if value is None or value is True or value is False:
        return value
    t, d = type(value), depth + 1
    if t is str:
        return value
    if t is int:
        return value if -_INT_MAX <= value < _INT_MAX else {"$i": hex(value)}
    if t is float:
        if value != value or value in (float("inf"), float("-inf")):
            return {"$f": repr(value)}
        return value
    if t is list:
        return [to_wire(v, d) for v in value]
    if t is tuple:
        return {"$t": [to_wire(v, d) for v in value]}
    if t is dict:
        return {"$d": [[to_wire(k, d), to_wire(v, d)] for k, v in value.items()]}
    if t is set:
        return {"$s": [to_wire(v, d) for v in value]}
    if t is frozenset:
        return {"$fs": [to_wire(v, d) for v in value]}
    if t is bytes:
        return {"$b": value.hex()}
    if t is bytearray:
        return {"$ba": value.hex()}
    if t is complex:
        return {"$c": [to_wire(value.real, d), to_wire(value.imag, d)]}
    return to_wire(_base_value(value), depth)


def _base_value(value):
    """The builtin base type's value of an instance of a subclass of a plain type (an IntEnum, an
    OrderedDict, a Counter); the subclass's own methods are never called."""
    for base, convert in (
        (int, int.__int__),
        (float, float.__float__),
        (complex, lambda v: complex(v.real, v.imag)),
        (str, str.__str__),
        (bytes, lambda v: bytes(memoryview(v))),
        (bytearray, lambda v: bytearray(memoryview(v))),
        (list, lambda v: list(list.__iter__(v))),
        (tuple, lambda v: tuple(tuple.__iter__(v))),
        (dict, lambda v: dict(dict.items(v))),
        (frozenset, lambda v: frozenset(frozenset.__iter__(v))),
        (set, lambda v: set(set.__iter__(v))),
    ):
        if isinstance(value, base):
            return convert(value)
    raise Unencodable(f"{type(value).__name__} is not plain data")


_TAGS = {
    "$t": lambda v: tuple(_items(v)),
    "$s": lambda v: set(_items(v)),
    "$fs": lambda v: frozenset(_items(v)),
    "$d": lambda v: _dict(v),
    "$b": lambda v: bytes.fromhex(_text(v)),
    "$ba": lambda v: bytearray.fromhex(_text(v)),
    "$f": lambda v: _special_float(_text(v)),
    "$i": lambda v: _big_int(_text(v)),
    "$c": lambda v: _complex(v),
}


def from_wire(obj):
    """The plain value a JSON-decoded object in the tagged encoding stands for; ValueError for
    anything that is not such an object (an unknown tag, a malformed one, an unhashable key)."""
    t = type(obj)
    if obj is None or t in (bool, int, float, str):
        return obj
    if t is list:
        return [from_wire(v) for v in obj]
    if t is dict and len(obj) == 1:
        ((tag, body),) = obj.items()
        if tag in _TAGS:
            try:
                return _TAGS[tag](body)
            except TypeError as e:
                raise ValueError(f"malformed {tag}: {e}") from None
    raise ValueError(f"not a value of the wire encoding: {type(obj).__name__}")


def _items(v):
    if type(v) is not list:
        raise ValueError("a tagged collection holds a list")
    return [from_wire(x) for x in v]


def _text(v):
    if type(v) is not str:
        raise ValueError("a tagged scalar holds a string")
    return v


def _dict(v):
    out = {}
    for pair in _items(v):
        if type(pair) is not list or len(pair) != 2:
            raise ValueError("a dict entry is a [key, value] pair")
        out[pair[0]] = pair[1]
    return out


def _special_float(s):
    if s not in ("nan", "inf", "-inf"):
        raise ValueError(f"bad special float {s!r}")
    return float(s)


def _big_int(s):
    if len(s) > 1 << 20:
        raise ValueError("integer too long")
    return int(s, 16)


def _complex(v):
    parts = _items(v)
    if len(parts) != 2 or not all(type(p) in (int, float) for p in parts):
        raise ValueError("a complex is [real, imag]")
    return complex(parts[0], parts[1])


def dumps(value):
    """`value` as one line of the tagged encoding (ASCII, no newline)."""
    return json_dumps(to_wire(value))


def loads(text):
    """The plain value of one line of the tagged encoding; ValueError if it is not one."""
    try:
        return from_wire(json_loads(text))
    except RecursionError:
        raise ValueError("nested too deeply") from None


def json_dumps(obj):
    """Compact ASCII JSON of `obj` (no NaN or Infinity), by the C encoder where there is one."""
    if _C is not None:
        return "".join(_C[1](obj, 0))
    import json

    return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def json_loads(text):
    """The JSON value of `text` (bare NaN and Infinity refused); ValueError if it is not JSON."""
    if type(text) is bytes:
        text = text.decode("utf-8")
    if _C is None:
        import json

        return json.loads(text, parse_constant=_no_constant)
    try:
        obj, end = _C[0](text, 0)
    except StopIteration:
        raise ValueError("not JSON") from None
    if text[end:].strip():
        raise ValueError("extra data after the JSON value")
    return obj


def _no_constant(name):
    raise ValueError(f"bare {name} is not in the wire encoding")


def _c_codec():
    """The C scanner and encoder of CPython's ``_json`` (importing ``json`` would import ``re``,
    which costs each sandboxed process more than the rest of its start-up), or None."""
    try:
        import _json

        class _Context:
            strict = True
            object_hook = None
            object_pairs_hook = None
            parse_float = float
            parse_int = int
            parse_constant = staticmethod(_no_constant)
            memo = {}

        scan = _json.make_scanner(_Context())
        encode = _json.make_encoder(
            None, _not_json, _json.encode_basestring_ascii, None, ":", ",", False, False, False
        )
        if scan('[1,"\\u00e9",{"a":null}]', 0)[0] != [1, "\u00e9", {"a": None}]:
            return None
        if "".join(encode([1, "\u00e9", {"a": None}], 0)) != '[1,"\\u00e9",{"a":null}]':
            return None
        return scan, encode
    except Exception:
        return None


def _not_json(obj):
    raise TypeError(f"{type(obj).__name__} is not JSON")


_C = _c_codec()
