"""The local cluster: everything in this process; threads keep the engine and trainer apart."""

from __future__ import annotations


class LocalCluster:
    """One process, one trainer rank, one engine (weir.loop builds them in-process)."""

    kind = "local"

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def start(self) -> LocalCluster:
        return self

    def describe(self) -> dict[str, object]:
        return {"type": "local", "trainer_ranks": 1, "engine_replicas": 1}

    def shutdown(self) -> None:
        """Nothing to release: the engine and trainer are closed by their owner."""
