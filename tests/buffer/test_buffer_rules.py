"""Hand-checked cases for StalenessBuffer: admission, drops, due-first batching, close, checkpoints."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from weir.buffer import BufferClosed, StalenessBuffer
from weir.data.sample import Group, Sample, Status


def group(ticket: int) -> Group:
    return Group(samples=[Sample(prompt_ids=[1, 2], response_ids=[3], reward=1.0)], group_id=ticket)


def admit_all(buf: StalenessBuffer, version: int) -> list[int]:
    out = []
    while (t := buf.try_admit(version)) is not None:
        out.append(t)
    return out


def finish(buf: StalenessBuffer, *tickets: int) -> None:
    for t in tickets:
        buf.put(t, group(t))


def ids(groups: list[Group]) -> list[int]:
    return [g.metadata["ticket"] for g in groups]


def test_eta0_is_synchronous():
    buf = StalenessBuffer(2, 0)
    assert admit_all(buf, 0) == [0, 1]
    finish(buf, 1, 0)
    batch = buf.get_batch(0)
    assert ids(batch) == [0, 1]
    assert [(g.metadata["admit_version"], g.metadata["trained_version"]) for g in batch] == [
        (0, 0)
    ] * 2
    assert buf.try_admit(0) is None  # version 0 is done
    assert admit_all(buf, 1) == [2, 3]
    buf.put(2, None)  # dropped: frees its slot
    assert admit_all(buf, 1) == [4]
    finish(buf, 3, 4)
    assert ids(buf.get_batch(1)) == [3, 4]
    assert buf.stats() == {
        "depth": 0,
        "in_flight": 0,
        "admitted": 5,
        "trained": 4,
        "dropped": 1,
        "max_staleness": 0,
        "batches": 2,
        "next_version": 2,
    }


def test_eta1_admission_and_due_first():
    buf = StalenessBuffer(2, 1)
    assert admit_all(buf, 0) == [0, 1, 2, 3]  # (0 + 1 + 1) * 2 = 4 non-dropped tickets
    finish(buf, 3, 2)
    assert ids(buf.get_batch(0, timeout=0)) == [2, 3]  # nothing due yet: finished ones go first
    assert buf.try_admit(0) is None  # 4 live < 4 fails
    assert admit_all(buf, 1) == [4, 5]  # 6 live < (1 + 1 + 1) * 2
    finish(buf, 4, 5)
    with pytest.raises(TimeoutError):  # 0 and 1 are due at version 1 and still in flight
        buf.get_batch(1, timeout=0.01)
    finish(buf, 0)
    buf.put(1, None)
    assert ids(buf.get_batch(1, timeout=0)) == [0, 4]  # 0 is due; 4 tops up by earliest deadline
    assert buf.stats()["max_staleness"] == 1
    assert admit_all(buf, 2) == [6, 7, 8]


def test_eta2_admission_counts():
    buf = StalenessBuffer(2, 2)
    assert admit_all(buf, 0) == [0, 1, 2, 3, 4, 5]
    buf.put(5, None)
    buf.put(4, None)
    assert admit_all(buf, 0) == [6, 7]
    finish(buf, 0, 1)
    assert ids(buf.get_batch(0, timeout=0)) == [0, 1]
    assert admit_all(buf, 1) == [8, 9]  # 8 non-dropped < (1 + 2 + 1) * 2
    assert buf.stats()["in_flight"] == 6


def test_fifo_counterexample_is_handled():
    """B=1, eta=2: plain FIFO over finished groups would train ticket 0 or 1 at version 3."""
    buf = StalenessBuffer(1, 2)
    assert admit_all(buf, 0) == [0, 1, 2]
    finish(buf, 2)
    assert ids(buf.get_batch(0, timeout=0)) == [2]
    assert admit_all(buf, 1) == [3]
    finish(buf, 3)
    with pytest.raises(TimeoutError):  # training 3 now would leave 0 and 1 both due at version 2
        buf.get_batch(1, timeout=0)
    finish(buf, 0)
    assert ids(buf.get_batch(1, timeout=0)) == [0]
    finish(buf, 1)
    assert ids(buf.get_batch(2, timeout=0)) == [1]
    assert ids(buf.get_batch(3, timeout=0)) == [3]
    assert buf.stats()["max_staleness"] == 2


def test_repeated_version_gets_a_fresh_slot():
    """A trainer that skips an update (empty step) asks twice at one version; eta=0 must not stall."""
    buf = StalenessBuffer(2, 0)
    finish(buf, *admit_all(buf, 0))
    buf.get_batch(0)
    buf_batches = []
    t = threading.Thread(target=lambda: buf_batches.append(buf.get_batch(0, timeout=5)))
    t.start()
    for _ in range(500):
        if buf.try_admit(0) is not None:
            break
        time.sleep(0.002)
    else:
        raise AssertionError("no admission while the trainer waits at version 0 again")
    finish(buf, 2, *admit_all(buf, 0))
    t.join(5)
    assert ids(buf_batches[0]) == [2, 3]


def test_put_errors():
    buf = StalenessBuffer(1, 0)
    t = buf.try_admit(0)
    buf.put(t, group(t))
    with pytest.raises(ValueError):
        buf.put(t, group(t))
    with pytest.raises(ValueError):
        buf.put(99, None)


def test_close_unblocks_and_drains():
    buf = StalenessBuffer(2, 1)
    tickets = admit_all(buf, 0)
    finish(buf, *tickets[:3])
    assert len(buf.get_batch(0)) == 2
    errors = []

    def consumer():
        try:
            buf.get_batch(1)
        except BufferClosed as err:
            errors.append(err)

    th = threading.Thread(target=consumer)
    th.start()
    time.sleep(0.02)
    assert th.is_alive()  # ticket 3 is due at version 1 and in flight
    buf.close()
    th.join(2)
    assert not th.is_alive() and len(errors) == 1
    assert buf.try_admit(5) is None


def test_state_dict_round_trip():
    buf = StalenessBuffer(2, 1)
    assert admit_all(buf, 0) == [0, 1, 2, 3]
    finish(buf, 0, 1)
    g = group(2)
    g.samples[0].status = Status.TRUNCATED
    g.samples[0].metadata["x"] = [1, 2]
    buf.put(2, g)
    state = pickle.loads(pickle.dumps(buf.state_dict()))
    assert [t for t, _, _ in state["finished"]] == [0, 1, 2] and state["in_flight"] == [(3, 0)]

    new = StalenessBuffer(2, 1)
    new.load_state_dict(state)
    assert new.stats() == {**buf.stats(), "in_flight": 0, "dropped": 1}  # lost generation: dropped
    assert ids(new.get_batch(0)) == [0, 1]
    assert admit_all(new, 0) == [4]  # ticket 3's generation was lost: its slot is free
    assert admit_all(new, 1) == [5, 6]
    finish(new, 4)
    g2, g4 = new.get_batch(1, timeout=0)
    assert g2.metadata["ticket"] == 2 and g2.samples[0].status is Status.TRUNCATED
    assert g2.samples[0].metadata == {"x": [1, 2]} and g2.samples[0].response_ids == [3]
    assert g4.metadata["ticket"] == 4
