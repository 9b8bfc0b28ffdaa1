"""A `TorchEngine` inside a Ray actor, so that engine replicas can run anywhere in a cluster.

The actor is asynchronous (its methods are coroutines): many `generate` calls are in flight at
once and the TorchEngine batches them continuously in its own thread. Weight updates arrive
between decode steps as in one process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from weir.config.devices import choose_backends, resolve_dtype
from weir.config.sections import EngineConfig
from weir.engine.base import Completion, SamplingParams
from weir.engine.kv_budget import kv_options
from weir.engine.torch_engine import TorchEngine


class EngineWorker:
    """One engine replica: loads `model_path` and serves the Engine protocol over Ray.

    Args:
        engine: the run's engine section (dtype, batch size, KV budget).
        model_path: a model directory this node can read (or a hub name).
        index: the replica's index (its sampling seed is `seed + index`).
        load: `(model_path, dtype) -> (model, tokenizer, eos_token_ids)`, a module-level function
            (Ray ships it by reference). The driver passes the trainer's loader, so both sides run
            the same HF class, without this package importing training code.
        seed: the run's seed.
        on_gpu: whether this replica was given a GPU (cluster.engines.gpus > 0).
        cudnn_attention: allow cuDNN's attention backend there (`model.cudnn_attention`).
        deterministic: the run's `run.deterministic`; TF32 matmuls stay off when it is set.
        record_routing: record MoE routing for the trainer to replay (`algo.routing_replay`).

    A Ray worker is a fresh process with torch's default backend settings, so it chooses them
    as a trainer rank does (`weir.config.devices.choose_backends`).
    """

    def __init__(
        self,
        engine: EngineConfig,
        model_path: str,
        index: int,
        load: Callable[..., tuple],
        *,
        seed: int = 0,
        on_gpu: bool = False,
        cudnn_attention: bool = False,
        deterministic: bool = False,
        record_routing: bool = False,
    ) -> None:
        torch.set_num_threads(1)
        self.index = index
        device = torch.device("cuda" if on_gpu else "cpu")
        choose_backends(device, deterministic=deterministic, cudnn_attention=cudnn_attention)
        dtype = resolve_dtype(engine.dtype, device)
        model, tokenizer, eos_ids = load(model_path, dtype)
        model = model.to(device).eval()
        self.engine = TorchEngine(
            model,
            eos_token_ids=eos_ids,
            pad_token_id=tokenizer.pad_token_id,
            max_batch_size=engine.max_batch_size,
            seed=seed + index,
            num_threads=1,
            record_routing=record_routing,
            **kv_options(engine),
        )

    async def ping(self) -> int:
        """The replica's pid (answers once the actor is up)."""
        return os.getpid()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, vision: Any = None
    ) -> list[Completion]:
        if vision is None:
            return await self.engine.generate(prompt_ids, params)
        return await self.engine.generate(prompt_ids, params, vision=vision)

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        await self.engine.update_weights(state.items(), version)

    async def version(self) -> int:
        return self.engine.version

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def abort(self) -> None:
        await self.engine.abort()

    async def drain(self, timeout: float | None = None) -> bool:
        return await self.engine.drain(timeout)

    async def stats(self) -> dict[str, float]:
        return self.engine.stats()

    async def state_dict(self) -> dict:
        """The engine's sampling stream and version, for a run checkpoint."""
        return self.engine.state_dict()

    async def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    async def sleep(self, offload_weights: bool = False) -> None:
        await self.engine.sleep(offload_weights)

    async def wake(self, update_follows: bool = False) -> None:
        await self.engine.wake(update_follows)

    async def close(self) -> None:
        self.engine.close()
