"""The rollout side of asynchronous training: a thread that keeps prompts in flight.

It admits a prompt whenever the staleness buffer allows, runs the rollout function on it
(concurrently with every other admitted prompt), filters the finished group and hands it to the
buffer. It never waits for the trainer except through admission control.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable

from weir.buffer import StalenessBuffer
from weir.data.prompts import BadRow, DataError
from weir.data.sample import Group, Status
from weir.data.sources import PromptSource
from weir.rollout.collect import SKIP_METRICS, failed_group, skip_metric
from weir.rollout.single_turn import RolloutContext
from weir.telemetry.timeline import async_span


class RolloutProducer:
    """Generates groups into `buffer` from a background thread until `stop()` or the data runs out."""

    def __init__(
        self,
        ctx: RolloutContext,
        fn: Callable,
        prompts: PromptSource,
        buffer: StalenessBuffer,
        version: Callable[[], int],
        keep: Callable[[Group], bool] | None = None,
        *,
        regenerate_aborted: bool = False,
    ) -> None:
        self.ctx, self.fn, self.prompts, self.buffer, self.version, self.keep = (
            ctx,
            fn,
            prompts,
            buffer,
            version,
            keep,
        )
        self.regenerate_aborted = regenerate_aborted
        self.max_filtered_in_a_row = max(1000, 50 * buffer.batch_groups)
        self._filtered_in_a_row = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="weir-rollout", daemon=True)
        self._lock = threading.Lock()
        self._counts = {
            "rollout/filtered_groups": 0.0,
            **dict.fromkeys(SKIP_METRICS, 0.0),
            "rollout/admitted": 0.0,
            "rollout/regenerated_groups": 0.0,
        }
        self.error: BaseException | None = None
        self._rows: dict[int, dict] = {}  # ticket -> row, while it is being generated
        self._retry: deque[dict] = deque()  # rows to roll out before new ones (after a resume)
        self.exhausted = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def take_counts(self) -> dict[str, float]:
        """Counters since the last call (filtered groups, skipped prompts, admitted prompts)."""
        with self._lock:
            out, self._counts = self._counts, dict.fromkeys(self._counts, 0.0)
        return out

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def _main(self) -> None:
        try:
            asyncio.run(self._produce())
        except BaseException as err:  # surfaced to the trainer by the driver
            self.error = err
        finally:
            self.buffer.close()

    async def _produce(self) -> None:
        in_flight: set[asyncio.Task] = set()
        while not self._stop.is_set():
            with async_span("wait", "admission", cat="idle"):  # held back by the staleness bound
                ticket = await self.buffer.admit(self.version, self._stop)
            if ticket is None:
                break
            with self._lock:
                if self._retry:
                    row = self._retry.popleft()
                elif self.prompts.exhausted:
                    self.buffer.put(ticket, None)
                    self.exhausted = True
                    break
                else:
                    row = self.prompts.next_batch(1)[0]
                self._rows[ticket] = row
            self._count("rollout/admitted")
            task = asyncio.create_task(self._one(ticket, row))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if self.exhausted and in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
        for task in in_flight:
            task.cancel()

    async def _one(self, ticket: int, row: dict) -> None:
        """Roll out one prompt into `ticket`; every path ends the ticket exactly once."""
        try:
            group = await self._generate(ticket, row)
            if group is not None and self.keep is not None:
                try:
                    kept = bool(self.keep(group))
                except Exception as err:
                    raise ValueError(f"rollout.filter raised {type(err).__name__}: {err}") from err
                if not kept:
                    self._filtered_in_a_row += 1
                    self._count("rollout/filtered_groups")
                    if self._filtered_in_a_row >= self.max_filtered_in_a_row:
                        raise ValueError(
                            f"rollout.filter dropped {self._filtered_in_a_row} groups in a row; it keeps "
                            "(almost) nothing, so no batch can form: loosen it or check the rewards"
                        )
                    group = None
                else:
                    self._filtered_in_a_row = 0
        except asyncio.CancelledError:
            self._finish(ticket, None)
            raise
        except Exception as err:  # filter errors and the like stop the run with their message
            self._finish(ticket, None)
            self.error = self.error or err
            self.buffer.close()
            return
        self._finish(ticket, group)

    def _finish(self, ticket: int, group: Group | None) -> None:
        with self._lock:
            self.buffer.put(ticket, group)
            self._rows.pop(ticket, None)

    def snapshot(self) -> dict:
        """A consistent picture for a checkpoint: the buffer, the rows still being generated (they
        are rolled out again on resume) and the data position after them."""
        with self._lock:
            buffer = self.buffer.state_dict()
            requeue = [self._rows[t] for t, _ in buffer["in_flight"] if t in self._rows]
            requeue = list(self._retry) + requeue
            return {"buffer": buffer, "requeue": requeue, "prompts": self.prompts.state_dict()}

    def restore(self, state: dict) -> None:
        """Continue from `snapshot()`: finished groups wait in the buffer, unfinished rows go first."""
        self.buffer.load_state_dict(state["buffer"])
        self.prompts.load_state_dict(state["prompts"])
        with self._lock:
            self._retry.extend(state["requeue"])

    async def _generate(self, ticket: int, row: dict) -> Group | None:
        start = time.perf_counter()
        try:
            group = await self.fn(self.ctx, row)
            while self.regenerate_aborted and any(
                s.status == Status.ABORTED for s in group.samples
            ):
                self._count("rollout/regenerated_groups")
                group = await self.fn(self.ctx, row)
        except BadRow as err:
            self._count(skip_metric(err))
            return None
        except DataError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a user rollout function must not end the run
            group = failed_group(row, err)
        if not isinstance(group, Group):
            raise ValueError(
                f"rollout.function returned {type(group).__name__}, expected a weir Group"
            )
        group.group_id = ticket
        for i, s in enumerate(group.samples):
            s.group_id, s.index = ticket, i
        group.metadata["generate_seconds"] = time.perf_counter() - start
        return group
