"""Timeline spans written as Chrome trace JSON (open it in https://ui.perfetto.dev or chrome://tracing).

Synchronous phases on one thread are complete events ("X"); work that overlaps on one thread (the
asyncio rollout tasks) is recorded as async events ("b"/"e") with an id, so Perfetto draws each on
its own track. `span()` and `async_span()` write to the timeline the run installed with `use()`;
with none installed they cost a function call.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Timeline:
    """Collects trace events in memory (thread-safe) and writes them with `save()`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._events: list[dict[str, Any]] = []
        self._threads: dict[int, str] = {}
        self._lock = threading.Lock()
        self._last: dict[tuple[int, str], dict[str, Any]] = {}  # for merge_gap_ms
        self._t0 = time.perf_counter_ns()
        self._pid = os.getpid()

    def _now_us(self) -> float:
        return (time.perf_counter_ns() - self._t0) / 1000

    def _add(self, event: dict[str, Any]) -> dict[str, Any]:
        thread = threading.current_thread()
        stored = {"pid": self._pid, "tid": thread.ident or 0, **event}
        with self._lock:
            self._threads.setdefault(thread.ident or 0, thread.name)
            self._events.append(stored)
        return stored

    @contextmanager
    def span(
        self, name: str, cat: str = "phase", merge_gap_ms: float | None = None, **args: Any
    ) -> Iterator[None]:
        """A complete event on this thread. With `merge_gap_ms`, a span that starts within that
        many ms of the end of the previous one of the same name on the same thread extends it
        (args["merged"] counts them): a busy loop of short iterations stays one bar, and the
        trace stays small."""
        start = self._now_us()
        try:
            yield
        finally:
            end = self._now_us()
            if merge_gap_ms is None or not self._extend(name, start, end, merge_gap_ms * 1000):
                event = {
                    "name": name,
                    "cat": cat,
                    "ph": "X",
                    "ts": start,
                    "dur": end - start,
                    "args": {**args, "merged": 1} if merge_gap_ms is not None else args,
                }
                stored = self._add(event)
                if merge_gap_ms is not None:
                    self._last[(threading.get_ident(), name)] = stored

    def _extend(self, name: str, start: float, end: float, gap_us: float) -> bool:
        with self._lock:
            last = self._last.get((threading.get_ident(), name))
            if last is None or start - (last["ts"] + last["dur"]) > gap_us:
                return False
            last["dur"] = end - last["ts"]
            last["args"]["merged"] += 1
            return True

    @contextmanager
    def async_span(
        self, name: str, key: int | str, cat: str = "rollout", **args: Any
    ) -> Iterator[None]:
        self._add(
            {
                "name": name,
                "cat": cat,
                "ph": "b",
                "id": str(key),
                "ts": self._now_us(),
                "args": args,
            }
        )
        try:
            yield
        finally:
            self._add({"name": name, "cat": cat, "ph": "e", "id": str(key), "ts": self._now_us()})

    def save(self) -> Path:
        """Write the trace atomically (temporary file, then rename)."""
        with self._lock:
            meta = [
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self._pid,
                    "tid": tid,
                    "args": {"name": name},
                }
                for tid, name in self._threads.items()
            ]
            doc = {"traceEvents": meta + list(self._events), "displayTimeUnit": "ms"}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.path)
        return self.path


_current: Timeline | None = None


def use(timeline: Timeline | None) -> None:
    """Install the timeline that `span()` / `async_span()` record to (None: record nothing)."""
    global _current
    _current = timeline


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def span(name: str, cat: str = "phase", merge_gap_ms: float | None = None, **args: Any):
    """A synchronous phase on the current thread, e.g. `with span("train"): ...`; see
    `Timeline.span` for `merge_gap_ms`."""
    if _current is None:
        return _nothing()
    return _current.span(name, cat, merge_gap_ms, **args)


def async_span(name: str, key: int | str, cat: str = "rollout", **args: Any):
    """Work that overlaps other work on the same thread (an asyncio task), keyed by `key`."""
    return _current.async_span(name, key, cat, **args) if _current is not None else _nothing()
