"""Run a rollout function over a batch of rows concurrently; contain failures; filter; summarise."""

from __future__ import annotations

import asyncio
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

from weir.data.prompts import BadRow, DataError, PromptTooLong
from weir.data.sample import Group, Sample, Status
from weir.rollout.roles import role_metrics
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


SKIP_METRICS = ("rollout/skipped_long_prompts", "data/skipped_bad_rows")


def skip_metric(err: BadRow) -> str:
    """The counter a skipped row goes to: too long for data.max_prompt_tokens, or no usable prompt
    (said once per kind of problem, as a warning)."""
    if isinstance(err, PromptTooLong):
        return "rollout/skipped_long_prompts"
    _warn_bad_row(err)
    return "data/skipped_bad_rows"


async def _collect(
    ctx: RolloutContext, rows: list[dict], fn: Callable
) -> tuple[list[Group], dict[str, float]]:
    skips = dict.fromkeys(SKIP_METRICS, 0.0)

    async def one(row: dict) -> Group | None:
        try:
            return await fn(ctx, row)
        except BadRow as err:
            skips[skip_metric(err)] += 1
        except DataError:
            raise
        except Exception as err:  # a user rollout function must not end the run
            return failed_group(row, err)
        return None

    # Hold the engine until every rollout has submitted its first request, so the first batch the
    # engine forms is the whole step, in row order: better prefill batching, and the same batches
    # (hence bit-identical log-probs) every time the step is run.
    hold = hasattr(ctx.engine, "pause") and hasattr(ctx.engine, "resume")
    if hold:
        await ctx.engine.pause()
    tasks = [asyncio.ensure_future(one(r)) for r in rows]
    try:
        await asyncio.sleep(0)
    finally:
        if hold:
            await ctx.engine.resume()
    results = await asyncio.gather(*tasks)
    return [g for g in results if g is not None], skips


_warned: set[str] = set()


def _warn_bad_row(err: BadRow) -> None:
    """Say once per kind of problem what is wrong with the data; later rows of that kind are only counted."""
    kind = str(err).split(":", 1)[-1].strip()[:60]
    if kind not in _warned and len(_warned) < 20:
        _warned.add(kind)
        warnings.warn(f"skipping a data row: {err}", stacklevel=1)


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
        truncated = getattr(ctx.encode, "truncated", 0)
        groups, skips = asyncio.run(_collect(ctx, rows, fn))
        if rows and skips["data/skipped_bad_rows"] == len(rows):
            raise DataError(
                f"none of the {len(rows)} prompts of this step could be used (each row is missing its "
                "prompt or has an empty one); check data.prompt_key and the data file"
            )
    for gid, g in enumerate(groups):
        g.group_id = gid
        for i, s in enumerate(g.samples):
            s.group_id, s.index = gid, i
    elapsed = time.perf_counter() - start
    metrics = summarize(groups)
    metrics.update(skips)
    metrics["data/truncated_prompts"] = float(getattr(ctx.encode, "truncated", 0) - truncated)
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
    out.update(role_metrics(samples))  # multi-agent episodes: reward/<role>/mean, ...
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
