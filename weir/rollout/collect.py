"""Run a rollout function over a batch of rows concurrently; contain failures; filter; summarise."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from weir.data.prompts import PromptTooLong
from weir.data.sample import Group, Sample, Status
from weir.rollout.single_turn import RolloutContext
from weir.telemetry.timeline import span


def failed_group(row: dict, err: BaseException) -> Group:
    sample = Sample(
        prompt_ids=[],
        status=Status.FAILED,
        error=f"RolloutError: {type(err).__name__}: {err}",
        row=row,
    )
    return Group(samples=[sample], row=row)


async def _collect(ctx: RolloutContext, rows: list[dict], fn: Callable) -> tuple[list[Group], int]:
    async def one(row: dict) -> Group | None:
        try:
            return await fn(ctx, row)
        except PromptTooLong:
            return None
        except Exception as err:  # a user rollout function must not end the run
            return failed_group(row, err)

    results = await asyncio.gather(*(one(r) for r in rows))
    groups = [g for g in results if g is not None]
    return groups, len(results) - len(groups)


def collect_groups(
    ctx: RolloutContext,
    rows: list[dict],
    fn: Callable,
    *,
    keep: Callable[[Group], bool] | None = None,
) -> tuple[list[Group], dict[str, float]]:
    """Roll out every row; returns the groups that pass `keep` and step metrics.

    Each group gets `group_id` = its position in `rows`, unique within the step (GRPO groups by it).
    """
    start = time.perf_counter()
    with span("generate", rows=len(rows)):
        groups, skipped = asyncio.run(_collect(ctx, rows, fn))
    for gid, g in enumerate(groups):
        g.group_id = gid
        for i, s in enumerate(g.samples):
            s.group_id, s.index = gid, i
    elapsed = time.perf_counter() - start
    metrics = summarize(groups)
    metrics["rollout/skipped_long_prompts"] = float(skipped)
    metrics["time/generate"] = elapsed
    metrics["throughput/gen_tokens_per_s"] = metrics["rollout/gen_tokens"] / max(elapsed, 1e-9)
    if keep is not None:
        kept = []
        for g in groups:
            try:
                ok = bool(keep(g))
            except Exception as err:
                raise ValueError(f"rollout.filter raised {type(err).__name__}: {err}") from err
            if ok:
                kept.append(g)
        metrics["rollout/filtered_groups"] = float(len(groups) - len(kept))
        groups = kept
    return groups, metrics


def summarize(groups: list[Group]) -> dict[str, float]:
    """Reward, length, truncation and failure statistics over all samples of `groups`."""
    samples = [s for g in groups for s in g.samples]
    rewards = [s.reward for s in samples if s.reward is not None]
    lengths = [len(s.response_ids) for s in samples]
    failed = [s for s in samples if s.status == Status.FAILED]
    out: dict[str, Any] = {
        "reward/mean": statistics.fmean(rewards) if rewards else float("nan"),
        "reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "response/length_mean": statistics.fmean(lengths) if lengths else 0.0,
        "response/length_max": float(max(lengths, default=0)),
        "response/truncated_frac": sum(s.status == Status.TRUNCATED for s in samples)
        / max(len(samples), 1),
        "rollout/failed": float(len(failed)),
        "rollout/failed_frac": len(failed) / max(len(samples), 1),
        "rollout/samples": float(len(samples)),
        "rollout/gen_tokens": float(sum(lengths)),
    }
    # Per-sample counters a rollout function reports (e.g. agent/tool_errors): the step's sum and mean.
    extra: dict[str, list[float]] = {}
    for s in samples:
        for k, v in (s.metadata.get("metrics") or {}).items():
            extra.setdefault(k, []).append(float(v))
    for k, vs in extra.items():
        out[k] = sum(vs)
        out[f"{k}_mean"] = statistics.fmean(vs)
    return out


def failure_summary(groups: list[Group]) -> str:
    """The most frequent failure reasons, for an error message."""
    counts: dict[str, int] = {}
    for g in groups:
        for s in g.samples:
            if s.status == Status.FAILED:
                key = (s.error or "unknown").split("\n")[0][:200]
                counts[key] = counts.get(key, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:3]
    return "; ".join(f"{n}x {reason}" for reason, n in top)
