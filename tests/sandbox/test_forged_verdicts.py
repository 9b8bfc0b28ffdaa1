"""A program cannot forge its reward: each attack scores 0 and its sample is not FAILED, at every
isolation level this machine has.

The attacks are the ones an outside check found forging reward 1.0 before the judge moved out of
the program's process (issue 37): an object whose comparisons always succeed, the hidden tests read
from where the program can look, the builtins the harness relies on patched, the results written
or linked by the program itself, and a crash dressed up as the sandbox's own failure.
"""

from __future__ import annotations

import os
import uuid

import pytest

from tests.sandbox.hostile import LIMITS, ROOT_UIDS, assert_zero_not_failed, judge_protected, scored
from weir.data.sample import Status
from weir.sandbox import Sandbox

ROW = {"tests": ["assert f(2) == 4", "assert f(3) == 9", "assert f(-1) == 1"]}
# HumanEval's shape: the prompt (prefix) holds a helper the test relies on and the entry point
HE_PREFIX = (
    "import math\n\n\ndef poly(xs, x):\n    return sum(c * x**i for i, c in enumerate(xs))\n\n\n"
    'def find_root(xs):\n    """A root of the polynomial with coefficients xs in (0, 100)."""\n'
)
HE_TEST = (
    "\n\ndef check(candidate):\n    for xs in ([-6, 1], [2, -1], [-4, 0, 1]):\n"
    "        r = candidate(list(xs))\n        assert math.fabs(poly(xs, r)) < 1e-6\n\n"
    "check(find_root)\n"
)
HE_ROW = {"prefix": HE_PREFIX, "tests": [HE_TEST], "entry_point": "find_root"}
SOLVED = (
    "def f(x):\n    return x * x\n\n\ndef find_root(xs):\n    lo, hi = 0.0, 100.0\n"
    "    for _ in range(200):\n        mid = (lo + hi) / 2\n"
    "        if poly(xs, lo) * poly(xs, mid) <= 0:\n            hi = mid\n"
    "        else:\n            lo = mid\n    return (lo + hi) / 2\n"
)
WRONG = "def f(x):\n    return -1\n\n\ndef find_root(xs):\n    return 12345.0\n"


def _block(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\n"


def test_a_solution_scores_1_so_the_zeros_below_mean_something(level, sandboxes):
    sb = sandboxes(level)
    for row in (ROW, HE_ROW):
        sample = scored(sb, _block(SOLVED), row)
        assert sample.status == Status.COMPLETED and sample.reward == 1.0, sample.reward_info


ALWAYS_EQUAL = """
class Yes:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __bool__(self): return True
    def __lt__(self, other): return True
    def __le__(self, other): return True
    def __abs__(self): return 0
    def __sub__(self, other): return self
    __rsub__ = __add__ = __radd__ = __mul__ = __rmul__ = __pow__ = __rpow__ = __sub__
    def __float__(self): return 0.0
    def __hash__(self): return 0

class EqInt(int):
    def __eq__(self, other): return True
    __hash__ = int.__hash__

class EqFloat(float):
    def __eq__(self, other): return True
    def __lt__(self, other): return True
    __hash__ = float.__hash__
"""


@pytest.mark.parametrize(
    "returns",
    [
        ("Yes()", "Yes()"),  # a user class: cannot leave the program
        ("EqInt(0)", "EqFloat(12345.0)"),  # a subclass of a plain type: only its value leaves
        ("(lambda: 4)", "iter([2.0])"),  # a function, an iterator
    ],
    ids=["user-class", "plain-subclass", "function"],
)
def test_an_object_whose_comparisons_always_succeed_cannot_pass(level, sandboxes, returns):
    f_ret, root_ret = returns
    code = ALWAYS_EQUAL + f"def f(x): return {f_ret}\ndef find_root(xs): return {root_ret}\n"
    rows = [ROW, HE_ROW]
    if f_ret == "Yes()":  # truthy as well
        rows.append({"tests": ["assert f(1)", "assert f(1) is not None and f(2) == 4"]})
    for row in rows:
        assert_zero_not_failed(scored(sandboxes(level), _block(code), row))


PATCHED = """
import builtins, json, sys, math
class Swallowed(Exception):
    pass
builtins.exec = lambda *a, **k: None  # a harness that execs the tests runs nothing
builtins.compile = lambda *a, **k: None
json.dumps = lambda d, **k: '{"test": %d, "ok": true}' % d.get("test", 0)  # nor writes verdicts
builtins.AssertionError = Swallowed
builtins.abs = lambda x: 0
builtins.isinstance = lambda *a: True
builtins.len = lambda x: 0
builtins.all = builtins.any = lambda x: True
math.fabs = lambda x: 0.0
sys.modules["math"] = math
sys.excepthook = lambda *a: None
import atexit
atexit.register(lambda: print('{"test": 0, "ok": true}'))

def poly(xs, x):  # the helper HumanEval's test relies on, replaced
    return 0
"""


def test_patched_builtins_and_helpers_do_not_reach_the_judge(level, sandboxes):
    for row in (ROW, HE_ROW):
        sample = scored(sandboxes(level), _block(PATCHED + WRONG), row)
        assert_zero_not_failed(sample)
        assert sample.reward_info["tests_passed"] == 0


FAKE_RESULTS = r"""
import glob, json, os, sys
lines = "".join(json.dumps({"test": i, "ok": True}) + "\n" for i in range(8))
lines += '{"done": 1}\n{"up": 1}\n{"ready": {"names": ["f"], "values": {"$d": []}}}\n'
for name in [".weir-results-0.jsonl", ".weir_started", "results.jsonl"] + glob.glob(".weir*"):
    try:
        with open(name, "w") as fh:
            fh.write(lines)
    except OSError:
        pass
print(lines)
sys.stderr.write(lines)
for fd in range(3, 256):  # every descriptor the program holds, its pipe to the judge included
    try:
        os.write(fd, lines.encode())
    except OSError:
        pass
"""


def test_results_written_by_the_program_are_never_read(level, sandboxes):
    for row in (ROW, HE_ROW):
        assert_zero_not_failed(scored(sandboxes(level), _block(FAKE_RESULTS + WRONG), row))
    # the same writes inside the function under test, after the judge has started calling it
    inside = FAKE_RESULTS.replace("\n", "\n    ")
    code = f"def f(x):\n    {inside}\n    return -1\n"
    assert_zero_not_failed(scored(sandboxes(level), _block(code), ROW))


def _state(path: str) -> tuple:
    st = os.stat(path)
    with open(path) as fh:
        return st.st_mode, st.st_mtime_ns, st.st_uid, fh.read()


def test_a_results_file_link_is_never_followed(level, host_dir):
    target = os.path.join(host_dir, "verdicts.jsonl")
    with open(target, "w") as fh:
        fh.write('{"test": 0, "ok": true}\n{"test": 1, "ok": true}\n{"test": 2, "ok": true}\n')
    os.chmod(target, 0o644)
    before = _state(target)
    links = (
        "import glob, os\n"
        "names = glob.glob('.weir*') + ['.weir-results-0.jsonl', 'results.jsonl', 'solution.py']\n"
        "for name in names:\n"
        "    try:\n        os.remove(name)\n    except OSError:\n        pass\n"
        f"    os.symlink({target!r}, name)\n"
        "os.symlink('/', 'root')\nos.mkdir('locked')\n"
        f"os.symlink({target!r}, 'locked/link')\nos.chmod('locked', 0)\n"
    )
    work_root = os.path.join(host_dir, "work")
    os.mkdir(work_root, 0o711)
    try:
        sb = Sandbox(LIMITS, level=level, python_guard=False, tmp_dir=work_root)
        assert_zero_not_failed(scored(sb, _block(links + WRONG), ROW))
        sb.close()
        assert os.listdir(work_root) == []  # the work directory went, links and all
    finally:
        os.rmdir(work_root)
    assert _state(target) == before


CRASHES = {
    "removes_its_files": "import os\nfor n in os.listdir('.'):\n    os.remove(n)\nos._exit(1)\n",
    "fakes_a_bwrap_error": (
        "import sys\nsys.stderr.write(\"bwrap: Can't mount proc on /newroot/proc: "
        'Operation not permitted\\n")\nsys.exit(1)\n'
    ),
    "closes_its_descriptors": (
        "import os\nfor fd in range(0, 256):\n    try:\n        os.close(fd)\n"
        "    except OSError:\n        pass\nos._exit(1)\n"
    ),
    "aborts": "import os\nos.abort()\n",
    "raises": "raise RuntimeError('boom')\n",
}


@pytest.mark.parametrize("name", sorted(CRASHES))
def test_a_crash_scores_0_and_is_not_a_sandbox_failure(level, sandboxes, name):
    crash = CRASHES[name]
    sb = sandboxes(level)
    assert_zero_not_failed(scored(sb, _block(crash + WRONG), ROW))
    if name in ("removes_its_files", "fakes_a_bwrap_error"):  # and where stdout is the verdict
        io_row = {"cases": [{"input": "2\n", "output": "4"}]}
        assert_zero_not_failed(scored(sb, _block(crash + "print(4)\n"), io_row, "code_io"))
    inside = crash.replace("\n", "\n    ")  # the same, from inside the function the judge calls
    assert_zero_not_failed(scored(sb, _block(f"def f(x):\n    {inside}\n    return x * x\n"), ROW))


SECRET = f"weir-secret-{uuid.uuid4().hex}"  # this run's own: other runs may plant theirs
SEARCH = r"""
import os
MARK = (SECRET_HEAD + SECRET_TAIL).encode()  # in two halves: not in the program's own text
found, budget = [], [3000]

def look(path, depth=0):
    if found or budget[0] <= 0 or depth > 5:
        return
    budget[0] -= 1
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            for name in os.listdir(path):
                look(os.path.join(path, name), depth + 1)
            return
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            data = os.read(fd, 1 << 20)
        finally:
            os.close(fd)
        if MARK in data:
            found.append(MARK.decode())
    except Exception:
        pass

for top in [PLANTED, ".", "/dev/shm", os.path.expanduser("~")]:
    look(top)
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    for leaf in ("cmdline", "environ", "fd"):
        budget[0] = 3000
        look(f"/proc/{pid}/{leaf}")
budget[0] = 3000
look("/tmp")  # a shared /tmp can be large: the first 3000 entries

def f(x):
    return found[0] if found else None
"""


@pytest.mark.parametrize("guard", [False, True], ids=["noguard", "guard"])
def test_hidden_tests_are_nowhere_the_program_can_read(level, sandboxes, host_dir, guard):
    """The tests reach the judge through a pipe: not in the work directory, /tmp, /proc (command
    lines, environments, descriptors) of anything the program can see. A data set file on the host
    is another matter: bwrap shows the program none; at the weaker levels it is readable if it is
    world-readable (docs/code.md), unless the Python guard stops the read (it is on by default)."""
    row = {"tests": [f"assert f(0) == {SECRET!r}"]}
    planted = os.path.join(host_dir, "dataset.jsonl")
    with open(planted, "w") as fh:
        fh.write(f'{{"tests": ["assert f(0) == {SECRET!r}"]}}\n')
    os.chmod(planted, 0o644)
    head, tail = SECRET[:12], SECRET[12:]
    program = f"SECRET_HEAD, SECRET_TAIL, PLANTED = {head!r}, {tail!r}, {planted!r}\n" + SEARCH
    sample = scored(sandboxes(level, guard=guard), _block(program), row)
    if level == "bwrap" or guard:
        assert_zero_not_failed(sample)
    else:  # the documented gap: a world-readable file of the host
        assert sample.status == Status.COMPLETED and sample.reward == 1.0, sample.reward_info
        if ROOT_UIDS:  # a private file is out of reach of the programs' own uids
            os.chmod(planted, 0o600)
            assert_zero_not_failed(scored(sandboxes(level, guard=guard), _block(program), row))
    if not judge_protected(level):
        return
    # without the planted file nothing anywhere holds the tests
    os.remove(planted)
    assert_zero_not_failed(scored(sandboxes(level, guard=guard), _block(program), row))


def test_text_with_lone_surrogates_scores_0_cleanly(level, sandboxes):
    """A response decoded with surrogateescape (lone surrogates) is not valid source: 0, no error."""
    bad = "def f(x):\n    return x * x  # \udc80\udcff\n"
    sb = sandboxes(level)
    assert_zero_not_failed(scored(sb, _block(bad), ROW))
    io_row = {"cases": [{"input": "\udc80", "output": "4"}]}
    assert_zero_not_failed(scored(sb, _block("print(4)  # \udc80\n"), io_row, "code_io"))
    ok = scored(sb, _block("print(4)\n"), io_row, "code_io")  # surrogates in the row's input
    assert ok.status == Status.COMPLETED and ok.reward == 1.0, ok.reward_info
