"""Real threads: an asyncio producer thread with random latencies and drops, the trainer in main."""

from __future__ import annotations

import asyncio
import random
import threading
import time

from weir.buffer import BufferClosed, StalenessBuffer
from weir.data.sample import Group, Sample


def test_threads_200_groups_and_close_unblocks_everyone():
    B, eta, steps = 4, 2, 50  # 200 trained groups
    buf = StalenessBuffer(B, eta)
    version = 0
    rng = random.Random(0)
    admitted: dict[int, int] = {}
    dropped: set[int] = set()
    producer_done = threading.Event()
    blocked_admits: list[int | None] = []

    async def one(ticket: int, delay: float, drop: bool) -> None:
        await asyncio.sleep(delay)
        buf.put(ticket, None if drop else Group([Sample([1], [2])], group_id=ticket))
        if drop:
            dropped.add(ticket)

    async def produce() -> None:
        tasks = set()
        while True:
            ticket = await buf.admit(lambda: version, poll_interval=0.005)
            if ticket is None:
                break
            admitted[ticket] = version  # >= the version admit() read
            task = asyncio.create_task(one(ticket, rng.random() * 0.004, rng.random() < 0.15))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        blocked_admits.append(ticket)  # admit returned None once closed
        await asyncio.gather(*tasks)

    def producer_main() -> None:
        asyncio.run(produce())
        producer_done.set()

    th = threading.Thread(target=producer_main, daemon=True)
    th.start()
    trained: dict[int, int] = {}
    start = time.perf_counter()
    for _ in range(steps):
        groups = buf.get_batch(version, timeout=10)
        for g in groups:
            t = g.metadata["ticket"]
            assert t not in trained
            assert g.metadata["trained_version"] == version
            assert g.metadata["admit_version"] <= admitted[t]
            assert version - g.metadata["admit_version"] <= eta
            trained[t] = version
        time.sleep(rng.random() * 0.002)  # training
        version += 1
    assert len(trained) == 200

    # the producer is now blocked in admit (the bound is full); a second consumer blocks in get_batch
    consumer_errors: list[BaseException] = []

    def consumer() -> None:
        try:
            while True:
                buf.get_batch(version)  # drains full batches, then raises
        except BufferClosed as err:
            consumer_errors.append(err)

    time.sleep(0.05)
    assert not producer_done.is_set()
    cth = threading.Thread(target=consumer, daemon=True)
    cth.start()
    buf.close()
    th.join(5)
    cth.join(5)
    assert producer_done.is_set() and blocked_admits == [None]
    assert not cth.is_alive() and len(consumer_errors) == 1
    assert time.perf_counter() - start < 10

    stats = buf.stats()
    assert stats["trained"] >= 200 and stats["dropped"] == len(dropped)
    assert (
        stats["trained"] + stats["dropped"] + stats["depth"] + stats["in_flight"]
        == stats["admitted"]
    )
    assert stats["admitted"] == len(admitted)
    assert stats["max_staleness"] <= eta
