"""Weighted combinations of rewards, and the up-front checks of the rewards that load things.

    reward = sum_i weight_i * r_i

over components ``{function, weight, kwargs, name, on_error}``; each `function` is anything
`get_reward` resolves (a built-in, ``reward_model``, ``judge``, a dotted path, even another
``combine``). Components run concurrently. Each component's value is in ``sample.reward_info`` under
its name and in the step's metrics as ``reward/<name>_mean`` (``reward/<name>`` is the step's sum).
A failing component fails the sample (contained and counted by `score`) unless its ``on_error`` is
``"zero"``: then it scores 0 and ``reward/<name>_failed`` counts it (``_failed_mean``: the fraction).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from weir.data.sample import Sample

__all__ = ["combine", "check_reward", "component_name"]

_ON_ERROR = ("fail", "zero")
_RESERVED = ("reward", "mean", "std")  # reward/mean and reward/std are the total's metrics


def component_name(component: Mapping[str, Any]) -> str:
    """A component's metric name: its ``name``, else its function's last dotted part."""
    if component.get("name"):
        return str(component["name"])
    fn = str(component["function"])
    return fn.replace(":", ".").rsplit(".", 1)[-1]


def _check_components(components: Any) -> list[dict[str, Any]]:
    if not isinstance(components, Sequence) or isinstance(components, str) or not components:
        raise ValueError(
            "combine needs components: a non-empty list of {function, weight, kwargs, name, on_error}"
        )
    out, names = [], set()
    for i, c in enumerate(components):
        if not isinstance(c, Mapping) or not c.get("function"):
            raise ValueError(f"reward component {i} needs a 'function' (got {c!r})")
        unknown = sorted(set(c) - {"function", "weight", "kwargs", "name", "on_error"})
        if unknown:
            raise ValueError(
                f"reward component {i} has unknown key(s) {unknown}; "
                "use function, weight, kwargs, name, on_error"
            )
        if c.get("on_error", "fail") not in _ON_ERROR:
            raise ValueError(f"reward component {i}: on_error must be 'fail' or 'zero'")
        weight = c.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"reward component {i}: weight must be a number, got {weight!r}")
        name = component_name(c)
        if name in _RESERVED:
            raise ValueError(
                f"reward component {i} is named {name!r}, which reward/{name} already means; "
                "give it another 'name'"
            )
        if name in names:
            raise ValueError(
                f"two reward components are named {name!r}; give them distinct 'name's"
            )
        names.add(name)
        out.append(
            {
                "function": c["function"],
                "weight": float(weight),
                "kwargs": dict(c.get("kwargs") or {}),
                "name": name,
                "on_error": c.get("on_error", "fail"),
            }
        )
    return out


_RESOLVED: dict[str, list[tuple[dict[str, Any], Callable]]] = {}
_RESOLVED_LOCK = threading.Lock()


def _resolve(components: Any) -> list[tuple[dict[str, Any], Callable]]:
    key = json.dumps(components, sort_keys=True, default=str)
    from weir.rollout.rewards import get_reward

    with _RESOLVED_LOCK:
        if key not in _RESOLVED:
            checked = _check_components(components)
            _RESOLVED[key] = [(c, get_reward(c["function"], **c["kwargs"])) for c in checked]
        return _RESOLVED[key]


async def _call(fn: Callable, sample: Sample, row: Mapping[str, Any]) -> dict[str, Any]:
    from weir.rollout.rewards import _is_async, _normalize, reward_name

    result = await fn(sample, row) if _is_async(fn) else await asyncio.to_thread(fn, sample, row)
    if asyncio.iscoroutine(result):
        result = await result
    return _normalize(result, reward_name(fn))


async def combine(
    sample: Sample, row: Mapping[str, Any], *, components: list[dict[str, Any]]
) -> dict[str, Any]:
    """``sum_i weight_i * r_i`` over `components` (see the module doc); returns ``{"reward",
    <name>: r_i, ...}`` and records each r_i as a per-sample metric ``reward/<name>``."""
    resolved = _resolve(components)
    results = await asyncio.gather(
        *(_call(fn, sample, row) for _, fn in resolved), return_exceptions=True
    )
    info: dict[str, Any] = {}
    values: dict[str, float] = {}
    failed: dict[str, float] = {}
    for (c, _), res in zip(resolved, results, strict=True):
        name = c["name"]
        if isinstance(res, BaseException):
            if isinstance(res, asyncio.CancelledError) or c["on_error"] == "fail":
                raise res
            info[f"{name}_error"] = f"{type(res).__name__}: {res}"
            values[name] = 0.0
        else:
            values[name] = res["reward"]
        if c["on_error"] == "zero":
            failed[name] = 1.0 if isinstance(res, BaseException) else 0.0
    total = sum(c["weight"] * values[c["name"]] for c, _ in resolved)
    metrics = sample.metadata.setdefault("metrics", {})
    metrics.update({f"reward/{n}": v for n, v in values.items()})
    metrics.update({f"reward/{n}_failed": v for n, v in failed.items()})
    return {**info, **values, "reward": total}


def check_reward(spec: Any, kwargs: Mapping[str, Any]) -> None:
    """Refuse up front (ValueError, one line) what would fail every sample: combine components
    that do not resolve, a reward model that cannot be loaded, a judge misconfigured."""
    from weir.rollout.rewards import get_reward

    if spec == "combine":
        for c in _check_components(kwargs.get("components")):
            get_reward(c["function"], **c["kwargs"])
            check_reward(c["function"], c["kwargs"])
    elif spec == "reward_model":
        from weir.rollout.reward_models import check_reward_model

        if "path" not in kwargs:
            raise ValueError(
                "reward_model needs kwargs.path: a sequence-classification model directory"
            )
        check_reward_model(**{**kwargs, "path": str(kwargs["path"])})
    elif spec == "judge":
        from weir.rollout.judge import Judge, check_judge

        missing = sorted({"base_url", "model"} - set(kwargs))
        if missing:
            raise ValueError(
                f"the judge reward needs kwargs {missing} (the endpoint and its model)"
            )
        opts = {k: v for k, v in kwargs.items() if k != "eos_texts"}
        check_judge(**opts)
        try:
            Judge(**opts)
        except TypeError as err:
            raise ValueError(f"judge: {err}") from None
