"""The sandbox: programs, harnesses and limits; hostile programs are stopped or denied; concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import threading
import time

import pytest

from weir.sandbox import LEVELS, Limits, Sandbox, detect
from weir.sandbox import sandbox as sandbox_module
from weir.sandbox.isolation import SLOT_UID_BASE, SLOT_UIDS
from weir.sandbox.uids import processes_of_uid

FAST = Limits(wall_s=4, cpu_s=1, memory_mb=256, processes=8, output_bytes=65536)
BEST = detect("auto")
SANDBOX_UIDS = range(SLOT_UID_BASE, SLOT_UID_BASE + SLOT_UIDS)


@pytest.fixture
def work_root():
    """A temp dir the sandbox's per-slot uids can reach (pytest's tmp_path is private to root)."""
    root = tempfile.mkdtemp(prefix="weir-test-sandbox-")
    os.chmod(root, 0o711)
    yield root
    os.rmdir(root)


def _work_dirs(root: str) -> list[str]:
    return [d for d in os.listdir(root) if d.startswith("weir-sandbox-")]


def test_program_gets_stdin_args_and_reports_output_exit_and_usage(work_root):
    sb = Sandbox(FAST, tmp_dir=work_root)
    r = sb.run(
        "import sys\nx = input()\nprint(x[::-1], *sys.argv[1:])\nprint('err', file=sys.stderr)\nsys.exit(3)",
        stdin="abc\n",
        args=["p", "q"],
    )
    assert r.status == "error" and r.exit_code == 3
    assert r.stdout == "cba p q\n" and r.stderr.strip() == "err"
    assert r.level == BEST.level and 0 < r.wall_s < FAST.wall_s and r.max_rss_mb > 1
    ok = sb.run("print(sum(range(10)))")
    assert (ok.status, ok.stdout, ok.reason) == ("ok", "45\n", "")
    assert _work_dirs(work_root) == []


def test_harness_reports_each_test_and_counts_unreached_ones_as_failed():
    sb = Sandbox(Limits(wall_s=3, cpu_s=1))
    program = "def f(x):\n    return 2 * x\n"
    r = sb.run(program, tests=["assert f(2) == 4", "assert f(3) == 7", "assert f(0) == 0"])
    assert [t.passed for t in r.tests] == [True, False, True] and r.passed == 2
    assert r.status == "error" and r.tests[1].error.startswith("AssertionError")
    assert "1/3 tests failed" in r.reason
    loop = sb.run(program, tests=["assert f(1) == 2", "while True: pass", "assert f(0) == 0"])
    assert [t.passed for t in loop.tests] == [True, False, False]
    assert loop.status in ("timeout", "cpu_time") and loop.tests[2].error == "not reached"
    broken = sb.run("def f(x) return x", tests=["assert f(1) == 1"])
    assert broken.passed == 0 and "SyntaxError" in broken.tests[0].error
    # a program that exits before the tests run passes none of them
    early = sb.run("import sys\nsys.exit(0)\ndef f(x): return x", tests=["assert f(1) == 1"])
    assert early.passed == 0


def _hostile(port: int, host_pid: int, secret: str, outside: str) -> dict[str, tuple[str, ...]]:
    """name -> (program, statuses that count as stopped or denied)."""
    return {
        "infinite_loop": ("while True: pass", ("timeout", "cpu_time")),
        "memory_bomb": ("x = []\nwhile True: x.append(bytearray(64 << 20))", ("memory",)),
        "fork_bomb": ("import os\nwhile True: os.fork()", ("processes", "denied")),
        "write_outside": (f"open({outside!r}, 'w').write('pwned')", ("denied", "error")),
        "read_planted": (f"print(open({secret!r}).read())", ("denied", "error")),
        "socket": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
            ("denied", "error"),
        ),
        "kill_parent": (
            f"import os, signal\nos.kill({host_pid}, signal.SIGKILL)\n"
            "os.kill(os.getppid(), signal.SIGKILL)",
            ("denied", "error", "killed"),
        ),
        "huge_output": ("while True: print('x' * 100000)", ("output_limit",)),
    }


CONFIGS = (
    [pytest.param(BEST.level, False, id=f"{BEST.level}-noguard")] if BEST.level != "rlimit" else []
)
CONFIGS.append(pytest.param("rlimit", True, id="rlimit-guard"))


@pytest.fixture
def leased(monkeypatch) -> set[int]:
    """The uids this test's sandboxes lease (tests on another worker may run sandboxes meanwhile, so
    a leak check looks at these, not at every sandbox uid of the machine)."""
    uids: set[int] = set()
    lease = sandbox_module.lease_uid

    @contextlib.contextmanager
    def recorded_lease():
        with lease() as uid:
            uids.add(uid)
            yield uid

    monkeypatch.setattr(sandbox_module, "lease_uid", recorded_lease)
    return uids


@pytest.mark.parametrize("level,guard", CONFIGS)
def test_hostile_programs_are_stopped_or_denied_and_the_host_is_unharmed(level, guard, leased):
    # the planted secret and the write target sit in a private (0700) directory outside the sandbox
    private = tempfile.mkdtemp(prefix="weir-host-")
    secret = os.path.join(private, "secret.txt")
    with open(secret, "w") as f:
        f.write("TOP-SECRET-42")
    outside = os.path.join(private, "pwned.txt")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    sb = Sandbox(FAST, level=level, python_guard=guard)
    programs = _hostile(server.getsockname()[1], os.getpid(), secret, outside)
    try:
        for name, (program, stopped) in programs.items():
            r = sb.run(program)
            assert r.status in stopped, (name, r.status, r.reason, r.stderr[-500:])
            assert r.reason, name  # why it stopped is recorded
            assert "TOP-SECRET-42" not in r.stdout, name
            assert r.wall_s < FAST.wall_s + 2, name
        with pytest.raises(BlockingIOError):
            server.accept()  # no program reached the host's socket
        assert not os.path.exists(outside)
        with open(secret) as f:
            assert f.read() == "TOP-SECRET-42"
        # the run goes on: the same sandbox still runs programs
        assert sb.run("print('alive')").stdout == "alive\n"
        if BEST.per_slot_uid:
            assert leased and processes_of_uid(leased) == []
    finally:
        server.close()
        for p in (secret, outside):
            if os.path.exists(p):
                os.remove(p)
        os.rmdir(private)


def test_level_in_force_is_the_level_claimed():
    """What a program can see matches the level the sandbox reports."""
    probe = (
        "import os, socket\n"
        "print(sorted(os.listdir('/')))\n"
        "try:\n    socket.create_connection(('10.255.255.1', 9), timeout=0.5)\n"
        "except OSError as e:\n    print('net', e.errno)\n"
        "print('pids', len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
    )
    r = Sandbox(FAST, python_guard=False).run(probe)
    assert r.status == "ok", r.stderr
    root, net, pids = r.stdout.splitlines()
    assert r.level == BEST.level in LEVELS
    host_root = sorted(os.listdir("/"))
    if BEST.level == "bwrap":
        assert "root" not in root and root != str(host_root) and "'sandbox'" in root
    if BEST.level in ("bwrap", "namespaces"):
        assert net == "net 101"  # ENETUNREACH: no interface but loopback
        assert int(pids.split()[1]) <= 4  # its own PID namespace
    else:
        assert root == str(host_root)


def test_200_parallel_executions_respect_the_cap_and_leak_nothing(work_root, leased):
    cap = 4
    sb = Sandbox(Limits(wall_s=20, cpu_s=5), max_parallel=cap, tmp_dir=work_root)
    running, peak, lock = 0, 0, threading.Lock()
    real = sb._run_in

    def counted(*a, **k):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        try:
            return real(*a, **k)
        finally:
            with lock:
                running -= 1

    sb._run_in = counted
    programs = [f"import time\nprint({i} * {i})" for i in range(200)]

    async def main():
        return await asyncio.gather(*(sb.arun(p) for p in programs))

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(200)]
    assert peak == cap
    stats = sb.stats()
    assert stats["executions"] == 200 and stats["ok"] == 200
    assert _work_dirs(work_root) == []
    if BEST.per_slot_uid:
        assert leased and processes_of_uid(leased) == []
    print(f"200 executions in {elapsed:.1f} s ({200 / elapsed:.1f}/s) at {BEST.level}")
    sb.close()


@pytest.mark.skipif(not BEST.per_slot_uid, reason="uids per execution need root")
def test_two_sandboxes_never_share_a_uid_so_one_cannot_kill_the_others_programs():
    a, b = Sandbox(Limits(wall_s=10), max_parallel=4), Sandbox(Limits(wall_s=10), max_parallel=4)
    program = "import os, time\ntime.sleep(0.5)\nprint(os.getuid())"

    async def main():
        return await asyncio.gather(*(s.arun(program) for s in (a, b) for _ in range(8)))

    results = asyncio.run(main())
    assert all(r.status == "ok" for r in results), {(r.status, r.reason) for r in results}
    assert all(int(r.stdout) in SANDBOX_UIDS for r in results)


def test_a_level_that_cannot_run_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="sandbox.level"):
        detect("chroot")
    with pytest.raises(ValueError, match="sandbox.python"):
        detect("rlimit", "/no/such/python3")
    with pytest.raises(ValueError, match="wall_s"):
        Limits(wall_s=0)
    if BEST.per_slot_uid:  # a work-directory root the slot uids cannot reach is refused up front
        private = tempfile.mkdtemp()
        try:
            with pytest.raises(ValueError, match="sandbox.tmp_dir"):
                Sandbox(tmp_dir=private).run("print(1)")
        finally:
            os.rmdir(private)


def test_a_probe_that_exits_with_an_error_is_not_run_again_but_a_timeout_is(monkeypatch):
    """A level whose trial run fails does not work here: one run decides. A trial that times out or
    is killed by a signal may only have met a busy machine, so it gets a second, longer try."""
    import subprocess

    from weir.sandbox import isolation

    calls: list[float] = []

    def failing(cmd, *, timeout, **kwargs):
        calls.append(timeout)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(isolation.subprocess, "run", failing)
    assert isolation._probe(["x"], None) is False
    assert calls == [20]

    calls.clear()

    def slow_then_ok(cmd, *, timeout, **kwargs):
        calls.append(timeout)
        if len(calls) == 1:
            raise subprocess.TimeoutExpired(cmd, timeout)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(isolation.subprocess, "run", slow_then_ok)
    assert isolation._probe(["x"], None) is True
    assert calls == [20, 60]

    calls.clear()

    def killed_then_ok(cmd, *, timeout, **kwargs):
        calls.append(timeout)
        return subprocess.CompletedProcess(cmd, -9 if len(calls) == 1 else 0)

    monkeypatch.setattr(isolation.subprocess, "run", killed_then_ok)
    assert isolation._probe(["x"], None) is True
    assert calls == [20, 60]
