"""The sandbox's limits hold, and are reported exactly, at every isolation level this machine has:
storage (the work directory, /tmp, /dev/shm), CPU time, file size, processes."""

from __future__ import annotations

import json

import pytest

from tests.sandbox.hostile import LIMITS, ROOT_UIDS

MB = 1 << 20

FILL = r"""
import json, os, sys
places, cap = json.loads(sys.argv[1]), 4 << 20  # stop at 4 MB a place: twice the limit
written = {}
for place in places:
    n = errno = 0
    while n < cap:
        try:
            with open(os.path.join(place, f"fill{n // (512 << 10)}"), "wb") as fh:
                fh.write(b"x" * (512 << 10))
            n += 512 << 10
        except OSError as e:
            errno = e.errno
            break
    written[place] = [n, errno]
print(json.dumps(written))
"""


def test_storage_is_bounded_where_the_level_says(level, sandboxes):
    """bwrap: the work directory, /tmp and /dev/shm are tmpfs mounts of `disk_mb` each (no space
    past it) and the rest of the file system is read-only. The other levels write the host's disk:
    files are bounded one by one (`file_bytes`), not in total, and /tmp and /dev/shm are the host's
    (only the Python guard keeps a program out of them)."""
    sb = sandboxes(level, disk_mb=2)
    if level == "bwrap":
        places = [".", "/tmp", "/dev/shm", "/", "/dev"]
        r = sb.run(FILL, args=[json.dumps(places)])
        assert r.status == "ok", (r.status, r.reason, r.stderr[-300:])
        written = json.loads(r.stdout)
        for place in (".", "/tmp", "/dev/shm"):
            n, errno = written[place]
            assert n <= 2 * MB and errno == 28, (place, n, errno)  # ENOSPC
        assert written["/"] == [0, 30] and written["/dev"] == [0, 30]  # EROFS
        spill = sb.run("for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * (512 << 10))")
        assert spill.status == "disk" and "disk limit 2 MB" in spill.reason, spill.reason
    else:
        r = sb.run(FILL, args=[json.dumps(["."])])
        assert r.status == "ok", (r.status, r.reason, r.stderr[-300:])
        assert json.loads(r.stdout)["."] == [4 * MB, 0]  # documented: no total bound here
        guarded = sandboxes(level, guard=True, disk_mb=2)
        for place in ("/tmp", "/dev/shm"):
            w = guarded.run(f"open('{place}/weir-fill-test', 'wb').write(b'x')")
            assert w.status == "denied", (place, w.status, w.reason)


SPIN = """
import sys, time
t0 = time.process_time()
while time.process_time() - t0 < float(sys.argv[1]):
    pass
"""
SPIN_REPORTING = """
import sys, time
last = 0.0
while True:
    now = time.process_time()
    if now - last > 0.05:
        print(round(now, 3), flush=True)
        last = now
"""


def test_cpu_seconds_are_those_the_program_used(level, sandboxes):
    """The CPU time reported is the program's, at every level: a 0.5 s spin reports it (bwrap
    once reported 0), one killed at the wall-clock limit reports at least what it had used, and one
    stopped by the CPU limit is reported as such."""
    r = sandboxes(level).run(SPIN, args=["0.5"])
    assert r.status == "ok", (r.status, r.reason)
    assert 0.5 <= r.cpu_s <= r.wall_s + 0.1, (r.cpu_s, r.wall_s)
    killed = sandboxes(level, wall_s=1.5, cpu_s=30).run(SPIN_REPORTING)
    assert killed.status == "timeout", (killed.status, killed.reason)
    used = float((killed.stdout.split() or [0])[-1])  # the last figure the program printed
    assert used - 0.05 <= killed.cpu_s <= killed.wall_s + 0.1, (used, killed.cpu_s)  # in ticks
    capped = sandboxes(level, wall_s=30, cpu_s=1).run(SPIN, args=["100"])
    # the kernel enforces the limit on its tick-sampled CPU time, which on a busy machine runs
    # ahead of the precise time reported
    assert capped.status == "cpu_time" and 0.7 <= capped.cpu_s < 1.5, (
        capped.status,
        capped.cpu_s,
    )


def test_a_python_program_stopped_by_the_file_size_limit_reports_file_size(level, sandboxes):
    r = sandboxes(level).run("open('big', 'wb').write(b'x' * (2 << 20))")
    assert r.status == "file_size", (r.status, r.reason, r.stderr[-300:])
    assert f"file size limit {LIMITS.file_bytes} bytes" in r.reason


FORK_BOMB = """
import os, sys, time
ran = 1
while ran < 64:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    ran += 1
print(ran)
"""
THREAD_BOMB = """
import threading, time
ran = 1
while ran < 64:
    try:
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
    except RuntimeError:
        break
    ran += 1
print(ran)
"""


@pytest.mark.parametrize("bomb", [FORK_BOMB, THREAD_BOMB], ids=["processes", "threads"])
def test_the_process_cap_counts_the_programs_processes_and_threads(level, sandboxes, bomb):
    """`processes` is what the program may have at once, its main process included, exactly where
    the count is its own (a uid of its own when weir is root, or a user namespace: bwrap and
    namespaces); at rlimit without root the user's other processes share the count."""
    r = sandboxes(level, memory_mb=2048).run(bomb)  # memory for 8 threads' stacks and arenas
    assert r.status == "ok", (r.status, r.reason, r.stderr[-300:])
    ran = int(r.stdout)
    if ROOT_UIDS or level != "rlimit":
        assert ran == LIMITS.processes
    else:  # approximate: room is left for the user's processes that run at the start
        assert ran <= LIMITS.processes + 16
