"""`lora.sync=adapter` in one process: each policy's LoRA adapter, alone, to its vLLM servers.

The trainer is in weir's process (`LoraActor`, or one per role with separate policies). A push
writes each policy's adapter as a peft directory (``adapter_config.json``,
``adapter_model.safetensors``: A and B only) and every server of that policy loads it through
vLLM's runtime LoRA endpoint under a name per version (`ServerEngine.update_adapter_sync`); the
servers' base weights never change. On Ray the same is `ServerSync`'s ``adapter`` transport.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class LocalAdapterSync:
    """Pushes the adapters of `trainer` (a `LoraActor`, or a `RoleTrainer` of them) to `engine`
    (a `ServerEngine`, or a `RoleRouter` of one per role), writing them under `root`."""

    def __init__(self, trainer: Any, engine: Any, root: str | Path) -> None:
        self.trainer, self.engine, self.root = trainer, engine, Path(root)
        self._last: dict[str, tuple[str, str]] = {}

    def _pairs(self) -> list[tuple[str, Any, Any]]:
        actors = getattr(self.trainer, "actors", None) or {"": self.trainer}
        engines = getattr(self.engine, "engines", None) or {"": self.engine}
        return [(role, actor, engines[role]) for role, actor in actors.items()]

    def push(self, version: int) -> dict[str, float]:
        """Write every policy's adapter and load it into its servers as `version`."""
        start, nbytes = time.perf_counter(), 0
        for role, actor, engine in self._pairs():
            path = self.root / (role or "policy") / f"v{version:06d}"
            actor.model.save_pretrained(str(path))
            nbytes += sum(f.stat().st_size for f in path.glob("*.safetensors"))
            name = f"weir-{role or 'policy'}-v{version}"
            engine.update_adapter_sync(path, name, version)
            self._last[role] = (str(path), name)
            engine.restore = self._restorer(engine, role)
        end = time.perf_counter()
        return {
            "time/sync": end - start,
            "sync/mb": nbytes / 2**20,
            "sync/mb_per_s": nbytes / 2**20 / max(end - start, 1e-9),
        }

    def _restorer(self, engine: Any, role: str) -> Any:
        """A restarted server of `role` loads the last adapter (its base weights are the model's)."""

        def restore(index: int) -> None:
            path, name = self._last[role]
            url = engine.replicas[index].url
            engine.run(engine.backend.load_adapter(engine._client, url, path, name))

        return restore
