"""What the engine did between two training steps, and which decode path it runs, as step metrics."""

from __future__ import annotations

import time

GAUGES = ("decode_direct", "decode_graphs")


def decode_path(stats: dict[str, float]) -> dict[str, float]:
    """The built-in engine's decode path from its `stats()`, summed over replicas:
    ``engine/decode_direct``, the engines whose decode steps run through weir's direct forward
    (`weir.engine.decode`; 0 where it was refused on its first-step check and the slower HF
    forward runs), and ``engine/decode_graphs``, the CUDA graphs captured for decode steps.
    Empty for engines that do not report them (vLLM, SGLang)."""
    return {f"engine/{key}": float(stats[key]) for key in GAUGES if key in stats}


class EngineLoad:
    """Between two calls of `sample()`: the fraction of wall time the engine was idle, and (built-in
    engine) the tokens it prefilled again to rebuild the KV of responses in flight across a weight
    update (`engine.kv_on_update=recompute`) and those it did not prefill because a prefix shared
    by the sequences of one prefill was computed once; with `decode_path`."""

    COUNTERS = ("recomputed_tokens", "shared_prefix_tokens")

    def __init__(self, engine) -> None:
        self.engine = engine
        stats = engine.stats()
        self.t, self.busy = time.perf_counter(), stats["busy_s"]
        self.counts = {k: stats[k] for k in self.COUNTERS if k in stats}

    def sample(self) -> dict[str, float]:
        stats = self.engine.stats()
        now, busy = time.perf_counter(), stats["busy_s"]
        span, used = now - self.t, busy - self.busy
        self.t, self.busy = now, busy
        out = {"engine/idle_frac": max(0.0, 1.0 - used / span)} if span > 0 else {}
        for key, last in self.counts.items():
            out[f"engine/{key}"] = max(0.0, float(stats[key] - last))
            self.counts[key] = stats[key]
        return {**out, **decode_path(stats)}
