"""`Sandbox`: run untrusted programs with tests, stdin and arguments, many at once under a cap.

``Sandbox(limits, level="auto", max_parallel=4).run("print(input())", stdin="hi")`` returns an
`ExecResult`. Each execution gets a fresh work directory (removed afterwards) and one of
`max_parallel` slots; callers beyond the cap wait for a slot (the wait is timed). `arun` is the same
off the event loop, in the sandbox's own thread pool. `stats()` gives running totals by status for
metrics; every execution is a ``sandbox.exec`` span on the calling thread's timeline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import shutil
import stat
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weir.sandbox.boot import import_path
from weir.sandbox.isolation import INNER_WORKDIR, JUDGE_UID, Isolation, detect
from weir.sandbox.judge_server import JudgeServer
from weir.sandbox.languages import DENIED_MARK, get_language
from weir.sandbox.limits import ExecResult, Limits, TestOutcome
from weir.sandbox.process import JudgeJob, RawResult, judge_limits, run_process
from weir.sandbox.uids import lease_uid
from weir.telemetry import timeline

__all__ = ["Sandbox", "classify"]

log = logging.getLogger(__name__)


def classify(raw: RawResult, limits: Limits) -> tuple[str, str]:
    """(status, reason) of the program's part of a finished execution: the sandbox's own kill
    reasons first, then the signal that ended it, then what its error output says (a denied
    operation, a memory, process, file-size or disk limit it ran into)."""
    if raw.start_error:
        return "sandbox_error", f"could not start the program: {raw.start_error}"
    if raw.killed_for == "timeout":
        return "timeout", f"wall time limit {limits.wall_s:g} s exceeded"
    if raw.killed_for == "output_limit":
        return "output_limit", f"output over {limits.output_bytes} bytes"
    if raw.killed_for == "lingered":
        return "ok", ""  # it outlived the judge, whose verdicts stand
    tail = raw.stderr[-4000:].decode("utf-8", "replace")
    sig = raw.signal
    if sig is None and raw.exit_code is not None and raw.exit_code > 128:
        sig = raw.exit_code - 128 if raw.exit_code - 128 in (9, 24, 25) else None  # via a wrapper
    if sig == 25:
        return "file_size", f"file size limit {limits.file_bytes} bytes exceeded"
    # RLIMIT_CPU's soft limit sends SIGXCPU (the launcher exits 128 + 24 on it); a program that
    # ignores it gets SIGKILL at the hard limit, which unshare reports as its own error: the CPU
    # time the kernel accounted decides (the limit is enforced on tick-sampled time, which can
    # run ahead of the precise time reported)
    soft_cpu = max(1, int(limits.cpu_s + 0.999))
    if sig == 24 or (raw.exit_code != 0 and raw.cpu_s >= 0.9 * soft_cpu):
        return "cpu_time", f"CPU time limit {limits.cpu_s:g} s exceeded"
    if raw.exit_code == 0:
        return "ok", ""
    if DENIED_MARK in tail:
        line = tail[tail.rindex(DENIED_MARK) :].splitlines()[0]
        return "denied", line.replace("weir-sandbox ", "", 1)
    last = next((ln for ln in reversed(tail.strip().splitlines()) if ln.strip()), "")
    if "MemoryError" in tail or "Cannot allocate memory" in tail:
        return "memory", f"memory limit {limits.memory_mb} MB exceeded ({last.strip()[:200]})"
    if "Resource temporarily unavailable" in tail and ("fork" in tail or "thread" in tail):
        return "processes", f"process limit {limits.processes} reached ({last.strip()[:200]})"
    if "[Errno 27] File too large" in last:
        return "file_size", f"file size limit {limits.file_bytes} bytes exceeded"
    if "[Errno 28] No space left on device" in last:
        return "disk", f"disk limit {limits.disk_mb} MB exceeded"
    if any(
        s in tail
        for s in (
            "Network is unreachable",
            "Read-only file system",
            "Permission denied",
            "Operation not permitted",
        )
    ):
        return "denied", last.strip()[:300]
    if sig is not None:
        return "killed", f"killed by signal {sig}"
    return "error", last.strip()[:300] or f"exit status {raw.exit_code}"


def _rmtree(path: str) -> None:
    """Remove a work directory even where the program took permissions away from its own files;
    never follows a link the program made (rmtree does not, and only real directories are
    chmod-ed)."""

    def fix(func: Any, p: str, _exc: Any) -> None:
        try:
            for d in (os.path.dirname(p), p):
                if stat.S_ISDIR(os.lstat(d).st_mode):
                    os.chmod(d, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)


class Sandbox:
    """Runs programs under `limits` at an isolation level (``auto``: the strongest that works here).

    `max_parallel` executions run at once; `python` is the interpreter for Python programs (default:
    weir's own, or the system's where the slot uids cannot reach weir's); `python_guard` installs the
    in-process audit hook (see `weir.sandbox.languages`); `tmp_dir` is where work directories go.
    """

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        level: str = "auto",
        max_parallel: int = 4,
        python: str | None = None,
        python_guard: bool = True,
        tmp_dir: str | None = None,
    ) -> None:
        if max_parallel < 1:
            raise ValueError(f"sandbox.max_parallel must be >= 1, got {max_parallel}")
        self.limits = limits or Limits()
        self.level_requested = level
        self.max_parallel = max_parallel
        self.python = python
        self.python_guard = python_guard
        self.tmp_dir = tmp_dir
        self._iso: Isolation | None = None
        self._slots: queue.Queue[int] = queue.Queue()
        for i in range(max_parallel):
            self._slots.put(i)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._stats: Counter[str] = Counter()
        self._judges: JudgeServer | None = None
        self._seconds: Counter[str] = Counter()

    @classmethod
    def from_config(cls, section: Any) -> Sandbox:
        """A sandbox from the `sandbox` config section (or any object with its attribute names)."""
        return cls(
            Limits.from_section(section),
            level=section.level,
            max_parallel=section.max_parallel,
            python=section.python,
            python_guard=section.python_guard,
            tmp_dir=section.tmp_dir,
        )

    @property
    def isolation(self) -> Isolation:
        """The isolation in force (detected on first use; a requested level that cannot run raises)."""
        if self._iso is None:
            iso = detect(self.level_requested, self.python)
            root = self.tmp_dir or tempfile.gettempdir()
            if iso.per_slot_uid and not all(
                os.stat(d).st_mode & 0o001
                for d in (Path(root).resolve(), *Path(root).resolve().parents)
            ):
                raise ValueError(
                    f"sandbox.tmp_dir={root!r} is not searchable by other users, and the sandbox runs "
                    "programs under uids of their own: chmod o+x it and its parents, or choose another"
                )
            self._iso = iso
        return self._iso

    def run(
        self,
        program: str,
        *,
        language: str = "python",
        stdin: str | bytes = "",
        args: Sequence[str] = (),
        tests: Sequence[str] | None = None,
        prefix: str | None = None,
        entry_points: Sequence[str] | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        """Run `program` and return what it did; never raises for anything the program does.
        Blocks while all slots are busy.

        With `tests` a judge process runs them (`weir.sandbox.judge`), calling the program's
        functions across a pipe: `prefix` is trusted code run first in the tests' namespace (the
        prompt's imports and helpers), and `entry_points` the names of the functions under test
        (default: every function the program defines)."""
        lang = get_language(language)
        iso = self.isolation
        limits = limits or self.limits
        t_wait = time.monotonic()
        slot = self._slots.get()
        waited = time.monotonic() - t_wait
        try:
            with contextlib.ExitStack() as stack:
                uid = stack.enter_context(lease_uid()) if iso.per_slot_uid else None
                workdir = None
                if iso.level != "bwrap":  # bwrap's work directory is a tmpfs of its own
                    workdir = tempfile.mkdtemp(prefix="weir-sandbox-", dir=self.tmp_dir)
                    stack.callback(_rmtree, workdir)
                    os.chmod(workdir, 0o700)
                    if uid is not None:
                        os.chown(workdir, uid, uid)
                with timeline.span("sandbox.exec", cat="sandbox", slot=slot, level=iso.level):
                    result = self._run_in(
                        lang,
                        iso,
                        workdir,
                        uid,
                        program,
                        stdin,
                        args,
                        tests,
                        limits,
                        prefix,
                        entry_points,
                    )
        except (OSError, RuntimeError) as e:  # the sandbox's own failure, not the program's
            result = ExecResult(
                "sandbox_error",
                None,
                "",
                "",
                0.0,
                reason=f"{type(e).__name__}: {e}",
                level=iso.level,
            )
        finally:
            self._slots.put(slot)
        result.queue_s = waited
        with self._lock:
            self._stats["executions"] += 1
            self._stats[result.status] += 1
            self._seconds["wall"] += result.wall_s
            self._seconds["cpu"] += result.cpu_s
            self._seconds["queue_wait"] += waited
        return result

    def _run_in(
        self,
        lang: Any,
        iso: Isolation,
        workdir: str | None,
        uid: int | None,
        program: str,
        stdin: str | bytes,
        args: Sequence[str],
        tests: Sequence[str] | None,
        limits: Limits,
        prefix: str | None = None,
        entry_points: Sequence[str] | None = None,
    ) -> ExecResult:
        prepared = lang.prepare(
            program,
            serve=tests is not None,
            args=args,
            guard=self.python_guard,
            iso=iso,
            reply_bytes=limits.output_bytes,
        )
        env = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": INNER_WORKDIR if workdir is None else workdir,
            "PYTHONHASHSEED": "0",
        }
        judge = None
        if tests is not None:
            config = {
                "tests": list(tests),
                "prefix": prefix,
                "entry_points": list(entry_points) if entry_points else None,
                "reply_bytes": limits.output_bytes,
                "limits": judge_limits(limits),
                "path": import_path(iso.python),
            }
            judge = JudgeJob(config, self._judge_server(iso, uid is not None))
        data = stdin.encode("utf-8", "surrogateescape") if isinstance(stdin, str) else stdin
        raw = run_process(
            prepared.argv,
            iso=iso,
            limits=limits,
            workdir=workdir,
            files=prepared.files,
            stdin=data,
            uid=uid,
            env=env,
            judge=judge,
        )
        status, reason = classify(raw, limits)
        if status in ("error", "killed") and not raw.started:
            first = raw.stderr.decode("utf-8", "replace").strip().splitlines()[:1]
            status = "sandbox_error"
            reason = f"the program never started: {first[0] if first else f'exit {raw.exit_code}'}"
        outcomes: list[TestOutcome] = []
        if tests is not None:
            outcomes = _outcomes(raw.judge, len(tests))
            judge_failure = _judge_failure(raw)
            hit = next((d for d in raw.judge if d.get("limit") == "cpu_time"), None)
            if judge_failure and status != "sandbox_error":
                status, reason = "sandbox_error", judge_failure
            elif hit is not None and status in ("ok", "error"):
                status = "cpu_time"  # a test's own code, run in the judge, used up the CPU limit
                reason = f"CPU time limit {limits.cpu_s:g} s exceeded in test {hit.get('test')}"
            elif status in ("ok", "error") and not all(t.passed for t in outcomes):
                failed = [t for t in outcomes if not t.passed]
                status = "error"
                reason = f"{len(failed)}/{len(tests)} tests failed; first: {failed[0].error}"
        return ExecResult(
            status=status,
            exit_code=raw.exit_code,
            stdout=raw.stdout.decode("utf-8", "replace"),
            stderr=raw.stderr.decode("utf-8", "replace"),
            wall_s=raw.wall_s,
            cpu_s=raw.cpu_s,
            max_rss_mb=raw.max_rss_mb,
            reason=reason,
            level=iso.level,
            tests=outcomes,
        )

    def _judge_server(self, iso: Isolation, own_uid: bool) -> JudgeServer:
        with self._lock:
            if self._judges is None:
                self._judges = JudgeServer(iso.python, JUDGE_UID if own_uid else None)
            return self._judges

    async def arun(self, program: str, **kwargs: Any) -> ExecResult:
        """`run` in the sandbox's own thread pool (`max_parallel` threads), off the event loop."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.max_parallel, thread_name_prefix="weir-sandbox"
                )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: self.run(program, **kwargs))

    def stats(self) -> dict[str, float]:
        """Totals since creation: executions, executions per status, and wall / CPU / queue-wait seconds."""
        with self._lock:
            out = {k: float(v) for k, v in self._stats.items()}
            out.update({f"{k}_s": v for k, v in self._seconds.items()})
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._judges is not None:
            self._judges.close()


def _outcomes(report: list[dict[str, Any]], n: int) -> list[TestOutcome]:
    """One outcome per test from the judge's report; a test it never reported (the execution was
    stopped first) is failed, "not reached"."""
    seen: dict[int, TestOutcome] = {}
    for d in report:
        i = d.get("test")
        if type(i) is int and 0 <= i < n:
            error = d.get("error")
            seen[i] = TestOutcome(i, d.get("ok") is True, None if error is None else str(error))
    return [seen.get(i, TestOutcome(i, False, "not reached")) for i in range(n)]


def _judge_failure(raw: RawResult) -> str | None:
    """Why the judge itself failed (it never started, or reported an error of its own), or None.
    A judge stopped by a limit, or by weir at the deadline, is not the sandbox's failure: the tests
    it had not reported count as failed."""
    if raw.start_error or raw.killed_for in ("timeout", "output_limit"):
        return None
    for d in raw.judge:
        if "judge_error" in d:
            lines = str(d["judge_error"]).strip().splitlines()
            return f"the judge failed: {lines[-1] if lines else 'no reason given'}"
    if not any("up" in d for d in raw.judge):
        return "the judge never started"
    return None
