"""What a test sees of the program through the judge: its functions (called across the process
boundary), its exceptions, its plain globals; what it cannot: anything but plain data, and a call
that failed at the boundary is never swallowed."""

from __future__ import annotations

import pytest

from weir.sandbox import Limits, Sandbox

SB = Sandbox(Limits(wall_s=8, cpu_s=4))


@pytest.fixture(scope="module", autouse=True)
def _close():
    yield
    SB.close()


def _passed(program: str, tests: list[str], **kw) -> list[bool]:
    r = SB.run(program, tests=tests, **kw)
    assert r.status != "sandbox_error", r.reason
    return [t.passed for t in r.tests]


def test_arguments_results_and_exceptions_cross_as_plain_values():
    program = (
        "def echo(*a, **k):\n    return [a, k]\n\n"
        "def neg(x):\n    if x < 0:\n        raise ValueError('negative: %d' % x)\n    return x\n\n"
        "class Mine(Exception):\n    pass\n\n"
        "def mine():\n    raise Mine('custom')\n\nTABLE = {1: (2, 3)}\n"
    )
    tests = [
        "assert echo(1, (2, 3), {4: {5}}, x=b'\\x00') == [(1, (2, 3), {4: {5}}), {'x': b'\\x00'}]",
        "try:\n    neg(-2)\nexcept ValueError as e:\n    assert str(e) == 'negative: -2'\n"
        "else:\n    assert False",
        "try:\n    mine()\nexcept Exception as e:\n    assert 'Mine: custom' in str(e)\n"
        "else:\n    assert False",
        "assert TABLE == {1: (2, 3)}",
        "assert neg(float('nan')) != neg(float('nan'))",  # nan crosses as nan
        "lst = [3, 1]\necho(lst)\nassert lst == [3, 1]",  # arguments are copies
    ]
    assert _passed(program, tests) == [True] * len(tests)


def test_a_boundary_failure_fails_its_test_even_when_the_test_catches_it():
    program = (
        "class Box:\n    pass\n\ndef box():\n    return Box()\n\n"
        "def die():\n    import os\n    os._exit(0)\n\ndef f(x):\n    return x\n"
    )
    tests = [
        "try:\n    box()\nexcept BaseException:\n    pass",  # not plain data: fails anyway
        "assert f(1) == 1",
        "try:\n    die()\nexcept BaseException:\n    pass",  # the program is gone
        "assert f(1) == 1",  # not reached
    ]
    r = SB.run(program, tests=tests)
    assert [t.passed for t in r.tests] == [False, True, False, False]
    assert "cannot leave the program" in r.tests[0].error
    assert r.tests[3].error.startswith("not reached")
    assert r.status == "error" and "3/4 tests failed" in r.reason


def test_entry_points_and_the_trusted_prefix():
    """The prefix runs in the judge: its helpers are the tests', not the program's. Only the entry
    points come from the program; without entry points every function the program defines does."""
    prefix = "def helper(x):\n    return x + 1\n\ndef solve(x):\n    '''helper(x) * 2'''\n"
    program = prefix + "def helper(x):\n    return 0\n\ndef solve(x):\n    return (x + 1) * 2\n"
    tests = ["assert solve(3) == helper(3) * 2 == 8"]
    assert _passed(program, tests, prefix=prefix, entry_points=["solve"]) == [True]
    # without entry points the program's helper (returning 0) is the one the test calls
    assert _passed(program, tests, prefix=prefix) == [False]


def test_a_program_without_the_entry_point_or_that_exits_first_passes_nothing():
    assert _passed("x = 1\n", ["assert f(1) == 1"], entry_points=["f"]) == [False]
    assert _passed("import sys\nsys.exit(0)\ndef f(x): return x\n", ["assert f(1) == 1"]) == [False]
    broken = SB.run("def f(x) return x", tests=["assert f(1) == 1"])
    assert broken.passed == 0 and "SyntaxError" in broken.tests[0].error
