"""What a sandboxed execution may use (`Limits`) and what it did (`ExecResult`, `TestOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Limits", "ExecResult", "TestOutcome", "STATUSES"]

# Why an execution ended. `ok`: exit status 0 (and, with tests, all of them passed); `error`: a
# non-zero exit (an exception) or a failed test; the rest are limits or denials the sandbox
# enforced, and `sandbox_error` is the sandbox's own failure (it could not start the program or the
# judge), which callers count apart from the program's.
STATUSES = (
    "ok",
    "error",
    "timeout",
    "cpu_time",
    "memory",
    "processes",
    "output_limit",
    "file_size",
    "disk",
    "denied",
    "killed",
    "sandbox_error",
)


@dataclass(frozen=True)
class Limits:
    """Resource limits of one execution.

    wall_s: real time from start to kill; cpu_s: CPU seconds (RLIMIT_CPU, SIGXCPU then SIGKILL a second
    later); memory_mb: address space per process (RLIMIT_AS); processes: processes and threads the
    program may have at once, its main process included (RLIMIT_NPROC, set inside the level's
    namespaces: exact under a uid of its own or in a user namespace, see docs/code.md);
    open_files: RLIMIT_NOFILE; output_bytes: stdout and stderr each, the program is killed past it
    (also the largest reply a program may send the judge); file_bytes: largest file it may write
    (RLIMIT_FSIZE); disk_mb: what each place it may write holds, MiB (at bwrap the work directory,
    /tmp and /dev/shm are tmpfs mounts of this size, in the host's memory; the other levels write
    the host's disk, bounded only per file).
    """

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512
    processes: int = 16
    open_files: int = 64
    output_bytes: int = 1 << 20
    file_bytes: int = 8 << 20
    disk_mb: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"sandbox limit {f.name} must be > 0, got {getattr(self, f.name)}")

    @classmethod
    def from_section(cls, section: Any) -> Limits:
        """Limits from any object with these attribute names (e.g. the `sandbox` config section)."""
        return cls(
            **{f.name: getattr(section, f.name) for f in fields(cls) if hasattr(section, f.name)}
        )


@dataclass
class TestOutcome:
    """One unit test of a harness: its index, whether it passed, and the error if it did not."""

    index: int
    passed: bool
    error: str | None = None


@dataclass
class ExecResult:
    """What one execution did.

    `status` is one of `STATUSES`; `reason` says why in words when it is not `ok` (the limit hit, the
    operation denied, the exception's last line). `tests` holds one `TestOutcome` per test of a harness
    run, in order: a test the program never reached (it timed out or exited first) counts as failed.
    `cpu_s` and `max_rss_mb` come from the kernel's accounting of the process tree (wait4); `queue_s`
    is how long the call waited for a free slot.
    """

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float = 0.0
    max_rss_mb: float = 0.0
    reason: str = ""
    level: str = ""
    tests: list[TestOutcome] = field(default_factory=list)
    queue_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def passed(self) -> int:
        return sum(t.passed for t in self.tests)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "wall_s": round(self.wall_s, 4),
            "cpu_s": round(self.cpu_s, 4),
            "max_rss_mb": round(self.max_rss_mb, 1),
            "level": self.level,
            "tests_passed": self.passed,
            "tests": len(self.tests),
        }
