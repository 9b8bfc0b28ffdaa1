"""Property test: a deterministic discrete-event simulation of producers, a fake engine and a trainer."""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from weir.buffer import StalenessBuffer
from weir.data.sample import Group, Sample


@st.composite
def scenarios(draw):
    return {
        "B": draw(st.integers(1, 4)),
        "eta": draw(st.integers(0, 3)),
        "steps": draw(st.integers(1, 6)),
        "latencies": draw(st.lists(st.integers(1, 30), min_size=1, max_size=40)),
        "drops": draw(st.lists(st.booleans(), max_size=30)),
        "train_times": draw(st.lists(st.integers(0, 10), min_size=1, max_size=8)),
        "lag": draw(st.integers(0, 3)),  # the engine sees a new version this much later
        "skip_bump": draw(st.lists(st.booleans(), max_size=6)),  # empty steps: no version bump
    }


def simulate(sc):
    B, eta = sc["B"], sc["eta"]
    buf = StalenessBuffer(B, eta)
    events: list[tuple[int, int, str, int]] = []  # (time, seq, kind, payload)
    seq = 0

    def schedule(t, kind, payload=0):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    version = 0  # the trainer's version
    engine_versions = [(0, 0)]  # (time from which the engine serves it, version)
    admitted: dict[int, int] = {}  # ticket -> version passed to try_admit
    dropped: set[int] = set()
    trained: dict[int, int] = {}  # ticket -> trained version
    batches: list[tuple[int, list[int]]] = []
    trainer_busy = False
    now = 0
    steps_done = 0
    ticks = 0

    def engine_version(t):
        return max(v for start, v in engine_versions if start <= t)

    def admit_all() -> bool:
        any_ = False
        while (ticket := buf.try_admit(engine_version(now))) is not None:
            any_ = True
            admitted[ticket] = engine_version(now)
            schedule(now + sc["latencies"][ticket % len(sc["latencies"])], "done", ticket)
        return any_

    while steps_done < sc["steps"]:
        ticks += 1
        assert ticks < 10_000, "simulation stalled: the buffer deadlocked"
        progress = True
        while progress:  # producers and trainer react to each other until both must wait
            # producers: admit everything the bound allows at the engine's version
            progress = admit_all()
            # trainer: take a batch if idle (a waiting trainer can open up admission)
            if trainer_busy:
                continue
            try:
                groups = buf.get_batch(version, timeout=0)
            except TimeoutError:
                progress = admit_all()
                continue
            progress = trainer_busy = True
            assert len(groups) == B
            tickets = [g.metadata["ticket"] for g in groups]
            for g, t in zip(groups, tickets, strict=True):
                assert t not in trained, "trained twice"
                assert g.metadata["trained_version"] == version
                assert g.metadata["admit_version"] == admitted[t]
                trained[t] = version
            batches.append((version, tickets))
            schedule(now + sc["train_times"][steps_done % len(sc["train_times"])], "trained")
        if not events:
            raise AssertionError("nothing in flight and no batch: the buffer deadlocked")
        now, _, kind, payload = heapq.heappop(events)
        if kind == "done":
            drop = payload < len(sc["drops"]) and sc["drops"][payload]
            if drop:
                dropped.add(payload)
            buf.put(payload, None if drop else Group([Sample([1], [2])], group_id=payload))
        elif kind == "trained":
            skip = steps_done < len(sc["skip_bump"]) and sc["skip_bump"][steps_done]
            steps_done += 1
            trainer_busy = False
            if not skip:
                version += 1
                engine_versions.append((now + sc["lag"], version))
                schedule(now + sc["lag"], "engine")  # producers poll the engine's version
    return buf, admitted, dropped, trained, batches, version


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_simulated_async_training_respects_the_bound(sc):
    buf, admitted, dropped, trained, batches, version = simulate(sc)
    eta = sc["eta"]
    for t, tv in trained.items():
        assert tv - admitted[t] <= eta, f"ticket {t} admitted at {admitted[t]} trained at {tv}"
        assert t not in dropped
    stats = buf.stats()
    assert stats["admitted"] == len(admitted) == max(admitted) + 1
    assert stats["trained"] == len(trained)
    assert stats["dropped"] == len(dropped)
    assert (
        stats["trained"] + stats["dropped"] + stats["depth"] + stats["in_flight"]
        == stats["admitted"]
    )
    assert stats["max_staleness"] <= eta
    if eta == 0:
        assert all(tv == admitted[t] for t, tv in trained.items())
        # batch at version i holds exactly the surviving tickets admitted at i (the sync loop)
        for v, tickets in batches:
            expected = {t for t, av in admitted.items() if av == v and t not in dropped}
            in_batches = {t for bv, ts in batches if bv == v for t in ts}
            if v < version:
                assert in_batches == expected
            assert set(tickets) <= expected
