"""One engine per role behind one `Engine`: multi_agent.policies=separate.

With separate policies each role has its own model, so each has its own built-in engine. The
loops, the producer and the checkpoint code talk to one engine; `RoleRouter` is that engine. A
request goes to its role's engine: the multi-agent rollout asks ``engine.for_role(name)`` for the
engine of the role that acts (or passes ``role=`` to `generate`); a request that names no role is
refused, since no policy could be the right one for it.

Weights arrive as one stream of ``"<role>/<parameter name>"`` tensors (`RoleTrainer.weights`), are
split by role and loaded into each role's engine under one version number, so a token's version
means the same step whichever role produced it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from weir.config.episode_sections import ROLE_SEP
from weir.engine.base import Completion, SamplingParams, SyncControl


def split_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]], roles: Iterable[str]
) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """``"<role>/<name>"`` tensors -> {role: [(name, tensor), ...]} (no copies). A name without a
    known role raises KeyError."""
    out: dict[str, list[tuple[str, torch.Tensor]]] = {r: [] for r in roles}
    for full, tensor in named_tensors:
        role, _, name = full.partition(ROLE_SEP)
        if role not in out or not name:
            raise KeyError(f"weight {full!r} names no role of {sorted(out)} ('<role>/<name>')")
        out[role].append((name, tensor))
    return out


class RoleRouter(SyncControl):
    """Routes each request to its role's engine; pause, resume, abort, sleep, close and weight
    updates go to every engine.

    ``version`` is the lowest of the engines' versions: while an update is under way some roles
    already have the new weights and some not, and admission control must count the older."""

    def __init__(
        self,
        engines: dict[str, Any],
        *,
        sleep_while_training: bool = False,
        offload_weights: dict[str, bool] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("RoleRouter needs at least one role's engine")
        self.engines = dict(engines)
        self.sleep_while_training = sleep_while_training
        self.offload_weights = dict(offload_weights or {})

    @property
    def roles(self) -> list[str]:
        return list(self.engines)

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines.values())

    @property
    def retries(self) -> int:
        """Requests retried after a replica or server failed, over every role's engine."""
        return sum(int(getattr(e, "retries", 0)) for e in self.engines.values())

    @property
    def restarts(self) -> int:
        return sum(int(getattr(e, "restarts", 0)) for e in self.engines.values())

    def for_role(self, role: str) -> Any:
        """The engine that generates `role`'s turns."""
        try:
            return self.engines[role]
        except KeyError:
            raise KeyError(f"no engine for role {role!r}; the roles are {self.roles}") from None

    # -- the Engine protocol -------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, role: str | None = None
    ) -> list[Completion]:
        if role is None:
            raise ValueError(
                "multi_agent.policies=separate: each role has its own engine, so a request must "
                f"name its role (engine.for_role(name) or generate(..., role=name)); roles {self.roles}"
            )
        return await self.for_role(role).generate(prompt_ids, params)

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Load ``"<role>/<name>"`` tensors into each role's engine and stamp all with `version`.
        Every role must be present: an engine left on old weights under a new version would
        mislabel its tokens."""
        parts = split_weights(named_tensors, self.engines)
        missing = [r for r, tensors in parts.items() if not tensors]
        if missing:
            raise ValueError(f"update_weights: no weights for role(s) {missing}")
        for role, tensors in parts.items():
            await self.engines[role].update_weights(tensors, version)

    # -- what the loops call on the built-in engine ---------------------------------------------

    def pause_sync(self) -> None:
        for e in self.engines.values():
            e.pause_sync()

    def resume_sync(self) -> None:
        for e in self.engines.values():
            e.resume_sync()

    def abort_sync(self) -> None:
        for e in self.engines.values():
            e.abort_sync()

    def drain_sync(self, timeout: float | None = None) -> bool:
        """Drain every role's engine, all within `timeout` seconds together."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = True
        for e in self.engines.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = e.drain_sync(left) and done
        return done

    def close(self) -> None:
        for e in self.engines.values():
            e.close()

    @contextmanager
    def asleep(self, update_follows: bool = False) -> Iterator[None]:
        """With engine.sleep_while_training, every role's built-in engine frees its KV cache (and
        its weights when `offload_weights[role]`: an engine holding its own copy) until the block
        ends, also on error; an engine that decides itself (a router of Ray replicas, a server
        engine: their own `asleep`) does as it decides. Otherwise nothing happens.
        `update_follows`: a weight update comes right after (`EngineMemory.wake_sync`)."""
        with ExitStack() as stack:
            for role, e in self.engines.items():
                own = getattr(e, "asleep", None)
                if own is not None:
                    stack.enter_context(own(update_follows))
                elif self.sleep_while_training:
                    e.sleep_sync(offload_weights=self.offload_weights.get(role, False))
                    stack.callback(e.wake_sync, update_follows=update_follows)
            yield

    def stats(self) -> dict[str, float]:
        """The engines' counters summed, except ``busy_s``, their mean (so that the loop's
        ``engine/idle_frac`` is the mean idle fraction of the engines), plus each role's counters
        as ``<role>/<counter>``."""
        per_role = {r: e.stats() for r, e in self.engines.items()}
        out: dict[str, float] = {}
        for role, stats in per_role.items():
            for k, v in stats.items():
                out[k] = out.get(k, 0.0) + float(v)
                out[f"{role}/{k}"] = float(v)
        if "busy_s" in out:
            out["busy_s"] /= len(self.engines)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Each role's engine state (seed stream, version), for exact resumption."""
        return {r: e.state_dict() for r, e in self.engines.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if sorted(state) != sorted(self.engines):
            raise ValueError(
                f"checkpoint holds engine state for roles {sorted(state)}, this run has "
                f"{sorted(self.engines)}; was multi_agent.roles changed?"
            )
        for r, s in state.items():
            self.engines[r].load_state_dict(s)
