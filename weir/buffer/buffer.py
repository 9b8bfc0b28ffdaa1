"""`StalenessBuffer`: admission control and batching with bounded staleness (AReaL's rule).

Rollout producers (an asyncio thread) ask for an admission *ticket* before they start a
prompt, and hand back the finished group (or ``None`` when it was dropped). The trainer (main
thread) takes batches of ``B`` groups. With max staleness ``eta``, a group admitted while weight
version ``v`` was current is trained at a version ``<= v + eta``; ``eta = 0`` is the synchronous
loop. The trainer trains batch ``i`` at version ``i`` and then bumps the version to ``i + 1``.

Definitions. A ticket is *live* until it is dropped; its *deadline* is ``admit_version + eta``.
``n`` is the version of the next batch: ``i`` while ``get_batch(i)`` is waiting, ``i + 1``
once it has returned (and raised to any larger version a producer reports).

Admission (rule 2). Admit at version ``v`` iff ``untrained_live + n * B < (v + eta + 1) * B``.
When the trainer calls ``get_batch`` once per version, ``n * B`` is exactly the number of trained
groups, so this is AReaL's "non-dropped admitted tickets < (v + eta + 1) * B"; a dropped ticket
frees its slot. Counting ``n * B`` instead of the trained groups keeps the loop live when the
trainer takes a second batch at the same version (an empty step): it gets a fresh slot of ``B``.

Batching ("due first" + earliest deadline first). ``get_batch(i)`` returns

* every live, untrained ticket with deadline ``<= i`` (it waits while one is still in flight),
* topped up to ``B`` with finished groups in (deadline, ticket) order,

but only if, after removing them, the remaining untrained live tickets (finished or in flight)
satisfy ``F(i + 1)``: for every ``j``, ``#{deadline <= j} <= (j - i) * B``. Otherwise it waits.

Plain FIFO over finished groups is *not* safe: B=1, eta=2, tickets 0,1,2 admitted at version 0;
ticket 2 finishes first and is trained at 0; ticket 3 (admitted at 1) finishes and is trained at
1; now tickets 0 and 1 are both due at version 2 but only one fits.

Why the bound holds. Invariant F(n): no untrained live ticket has deadline ``< n`` and
``U(j) := #{untrained live, deadline <= j} <= (j - n + 1) * B`` for every ``j``.

* Admission at ``v`` (deadline ``d = v + eta``) needs ``untrained + 1 <= (d - n + 1) * B``, so
  ``d >= n`` and for ``j >= d``: ``U(j) + 1 <= untrained + 1 <= (d - n + 1) B <= (j - n + 1) B``;
  ``U(j)`` for ``j < d`` is unchanged. Drops and finishes never increase ``U``.
* ``get_batch(i)`` with ``i <= n`` only adds slots, so F(i) holds. By F(i), ``U(i) <= B``: the
  due tickets fit into one batch, and the batch takes all of them, so none is ever late. The
  batch is returned only if F(i + 1) holds for what remains, which restores the invariant for
  ``n = i + 1``.
* Progress: once every ticket has finished, the B earliest deadlines satisfy F(i + 1) (for
  ``U(j) >= B`` all B picks have deadline ``<= j``, so ``U'(j) = U(j) - B <= (j - i) B``; otherwise
  ``U'(j) = 0``), and top-up by earliest deadline is optimal for every ``j`` at once, so waiting
  is only ever for groups still in flight or not yet admitted; admission allows at least ``B``
  untrained tickets whenever producers see the trainer's version.

So, when the trainer calls ``get_batch`` with its current version and bumps the version at most
once per batch, every group is trained at ``trained_version <= admit_version + eta``. (If the
version jumps without batches, e.g. a resume with a fresh buffer, tickets admitted before the
jump may be late; ``stats()["max_staleness"]`` reports it.) With ``eta = 0`` every live ticket
admitted at version ``i`` is due at ``i``, so batch ``i`` is exactly those groups (rule 5).

Every ticket ends exactly once: ``put`` accepts a ticket only while it is in flight, and a
finished group leaves the buffer only in the batch that trains it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from weir.data.sample import Group, Sample, Status


class BufferClosed(RuntimeError):
    """`get_batch` cannot form another batch: the buffer was closed and nothing more can come."""


class StalenessBuffer:
    """Thread-safe bounded-staleness buffer of finished groups; see the module docstring."""

    def __init__(self, batch_groups: int, max_staleness: int) -> None:
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self._cond = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._closed = False
        self._next_ticket = 0
        self._next_version = 0  # n: the version of the next batch
        self._in_flight: dict[int, int] = {}  # ticket -> admit version
        self._finished: dict[int, tuple[int, Group]] = {}  # ticket -> (admit version, group)
        self._admitted = 0
        self._trained = 0
        self._dropped = 0
        self._batches = 0
        self._max_seen_staleness = 0

    # ---- admission ---------------------------------------------------------------------------

    def try_admit(self, version: int) -> int | None:
        """An admission ticket for a prompt started at weight `version`, or None if over the bound."""
        with self._cond:
            return self._try_admit_locked(version)

    def _try_admit_locked(self, version: int) -> int | None:
        if self._closed:
            return None
        B = self.batch_groups
        # a producer at a later version means the trainer is there: no batch will come before it
        self._next_version = max(self._next_version, version)
        untrained = len(self._in_flight) + len(self._finished)
        if untrained + self._next_version * B >= (version + self.max_staleness + 1) * B:
            return None
        ticket = self._next_ticket
        self._next_ticket += 1
        self._admitted += 1
        self._in_flight[ticket] = version
        self._notify_locked()
        return ticket

    async def admit(
        self,
        version_fn: Callable[[], int],
        stop: threading.Event | None = None,
        poll_interval: float = 0.01,
    ) -> int | None:
        """Wait until a ticket can be admitted at `version_fn()`; None once `stop` is set or closed.

        Wakes at once when the buffer changes, and polls `version_fn` every `poll_interval`
        seconds (the version changes outside the buffer).
        """
        loop = asyncio.get_running_loop()
        while True:
            if stop is not None and stop.is_set():
                return None
            version = version_fn()
            with self._cond:
                if self._closed:
                    return None
                ticket = self._try_admit_locked(version)
                if ticket is not None:
                    return ticket
                fut = loop.create_future()
                self._async_waiters.append((loop, fut))
            try:
                await asyncio.wait([fut], timeout=poll_interval)
            finally:
                with self._cond:
                    if (loop, fut) in self._async_waiters:
                        self._async_waiters.remove((loop, fut))

    # ---- producer side -----------------------------------------------------------------------

    def put(self, ticket: int, group: Group | None) -> None:
        """Hand back `ticket`'s finished group; None means it was dropped and frees its slot."""
        with self._cond:
            if ticket not in self._in_flight:
                raise ValueError(f"ticket {ticket} is not in flight (unknown, or already put)")
            admit_version = self._in_flight.pop(ticket)
            if group is None:
                self._dropped += 1
            else:
                group.metadata["ticket"] = ticket
                group.metadata["admit_version"] = admit_version
                self._finished[ticket] = (admit_version, group)
            self._notify_locked()

    # ---- trainer side ------------------------------------------------------------------------

    def get_batch(self, version: int, timeout: float | None = None) -> list[Group]:
        """The next `batch_groups` groups to train at `version`; blocks until they are available.

        Raises TimeoutError after `timeout` seconds (0: check once) and BufferClosed once the
        buffer is closed and no batch can be formed from what it holds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._next_version = version  # lower: a repeated version adds slots; higher: a jump
            self._notify_locked()  # admission may have opened up
            while True:
                picked = self._pick_locked(version)
                if picked is not None:
                    return self._take_locked(picked, version)
                if self._closed:
                    raise BufferClosed("the buffer is closed and holds no full batch")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no batch for version {version} within {timeout} s")
                self._cond.wait(remaining)

    def _pick_locked(self, version: int) -> list[int] | None:
        """Tickets of a batch for `version` that keeps the invariant, or None (must wait)."""
        B, eta = self.batch_groups, self.max_staleness
        # after close nothing in flight can arrive, so it can neither be waited for nor scheduled
        in_flight = {} if self._closed else self._in_flight
        if any(v + eta <= version for v in in_flight.values()):
            return None  # a due group is still being generated
        order = sorted(self._finished, key=lambda t: (self._finished[t][0], t))
        due = [t for t in order if self._finished[t][0] + eta <= version]
        if len(due) > B:  # impossible while the version advances once per batch (see docstring)
            return due[:B]
        picked = due + [t for t in order if self._finished[t][0] + eta > version][: B - len(due)]
        if len(picked) < B:
            return None
        chosen = set(picked)
        rest = sorted(
            [v + eta for t, (v, _) in self._finished.items() if t not in chosen]
            + [v + eta for v in in_flight.values()]
        )
        for count, d in enumerate(rest, start=1):
            if count > (d - version) * B:
                return None  # taking these would leave more due at some version than fit
        return picked

    def _take_locked(self, picked: list[int], version: int) -> list[Group]:
        groups = []
        for t in picked:
            admit_version, group = self._finished.pop(t)
            group.metadata["admit_version"] = admit_version
            group.metadata["trained_version"] = version
            self._max_seen_staleness = max(self._max_seen_staleness, version - admit_version)
            groups.append(group)
        self._trained += len(groups)
        self._batches += 1
        self._next_version = version + 1
        self._notify_locked()
        return groups

    # ---- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop admitting and wake every waiter; `get_batch` then drains full batches and raises."""
        with self._cond:
            self._closed = True
            self._notify_locked()

    @property
    def closed(self) -> bool:
        return self._closed

    def _notify_locked(self) -> None:
        self._cond.notify_all()
        waiters, self._async_waiters = self._async_waiters, []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # that event loop is closed
                loop.call_soon_threadsafe(_resolve, fut)

    def stats(self) -> dict[str, int]:
        """depth (finished, waiting), in_flight, admitted, trained, dropped, max_staleness, ..."""
        with self._cond:
            return {
                "depth": len(self._finished),
                "in_flight": len(self._in_flight),
                "admitted": self._admitted,
                "trained": self._trained,
                "dropped": self._dropped,
                "max_staleness": self._max_seen_staleness,
                "batches": self._batches,
                "next_version": self._next_version,
            }

    # ---- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Counters and finished-but-untrained groups (plain dicts); in-flight tickets are listed.

        `load_state_dict` counts the in-flight tickets as dropped: their generations are lost.
        """
        with self._cond:
            return {
                "batch_groups": self.batch_groups,
                "max_staleness": self.max_staleness,
                "next_ticket": self._next_ticket,
                "next_version": self._next_version,
                "admitted": self._admitted,
                "trained": self._trained,
                "dropped": self._dropped,
                "batches": self._batches,
                "max_seen_staleness": self._max_seen_staleness,
                "in_flight": sorted(self._in_flight.items()),
                "finished": [
                    (t, v, _group_to_dict(g)) for t, (v, g) in sorted(self._finished.items())
                ],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cond:
            self._closed = False
            self._next_ticket = state["next_ticket"]
            self._next_version = state["next_version"]
            self._admitted = state["admitted"]
            self._trained = state["trained"]
            self._dropped = state["dropped"] + len(state["in_flight"])
            self._batches = state["batches"]
            self._max_seen_staleness = state["max_seen_staleness"]
            self._in_flight = {}
            self._finished = {t: (v, _group_from_dict(g)) for t, v, g in state["finished"]}
            self._notify_locked()


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _group_to_dict(group: Group) -> dict[str, Any]:
    out = dataclasses.asdict(group)
    for s in out["samples"]:
        s["status"] = Status(s["status"]).value
    return out


def _group_from_dict(d: dict[str, Any]) -> Group:
    samples = [Sample(**{**s, "status": Status(s["status"])}) for s in d["samples"]]
    return Group(samples=samples, group_id=d["group_id"], row=d["row"], metadata=d["metadata"])
