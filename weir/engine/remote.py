"""Build the server engine that `engine.type` names (vllm or sglang) from the `engine` config section.

Where the servers run is a placement, given as `place` (`Placement`): child processes of this
process (None, the local cluster), Ray actors on the engines' bundles (`weir.loop.ray_build`), or
no process at all when `engine.urls` attaches to servers started elsewhere. The engine over them is
the same `ServerEngine` in every case.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from weir.engine.server_engine import ServerBackend, ServerEngine
from weir.engine.servers import Replica, ServerProcess, free_port

Placement = Callable[[Callable[[int, int, str], ServerProcess], int], list[Replica]]
"""`(launcher, count) -> replicas`: start `count` servers from `launcher(index, port, host)`
somewhere and return them serving (or raise, every one stopped)."""


def start_engine_servers(
    ecfg: Any,
    model_path: str,
    work_dir: str | Path,
    eos_token_ids: list[int],
    *,
    dtype: str,
    seed: int,
    place: Placement | None = None,
    tensor_parallel_size: int = 1,
    lora_rank: int | None = None,
) -> ServerEngine:
    """Start (or attach to) the servers of `ecfg` (an `EngineConfig`): logs and the weights the
    servers load live under `work_dir`. `place`: see the module docstring; `tensor_parallel_size`:
    GPUs per server; `lora_rank`: servers able to take LoRA adapters up to that rank (vLLM)."""
    kwargs = dict(
        eos_token_ids=eos_token_ids,
        dtype=dtype,
        seed=seed,
        place=place,
        tensor_parallel_size=tensor_parallel_size,
        lora_rank=lora_rank,
    )
    if ecfg.type == "vllm":
        from weir.engine.vllm_engine import start_vllm

        engine = start_vllm(ecfg, model_path, work_dir, **kwargs)
    elif ecfg.type == "sglang":
        from weir.engine.sglang_engine import start_sglang

        engine = start_sglang(ecfg, model_path, work_dir, **kwargs)
    else:
        raise ValueError(f"engine.type={ecfg.type!r} is not a server engine (vllm or sglang)")
    engine.sleep_mode = bool(ecfg.sleep_mode)
    return engine


def start_here(launcher: Callable[[int, int, str], ServerProcess], count: int) -> list[Replica]:
    """The local placement: `count` servers as child processes of this one, on 127.0.0.1."""
    replicas = []
    for i in range(count):
        proc = launcher(i, free_port(), "127.0.0.1")
        replicas.append(Replica(proc.url, proc))
    for r in replicas:
        r.process.start()
    return replicas


def launch_servers(
    backend: ServerBackend,
    ecfg: Any,
    model_path: str,
    work_dir: str | Path,
    launcher: Callable[[int, int, str], ServerProcess],
    *,
    eos_token_ids: list[int],
    max_len: int,
    seed: int,
    place: Placement | None = None,
) -> ServerEngine:
    """Attach to ``ecfg.urls``, or start ``ecfg.replicas`` servers where `place` puts them
    (default: here) in parallel; wait until every one answers its health check (if one does not,
    the others are stopped and the error names the log it wrote); return the engine over them."""
    replicas = [Replica(url.rstrip("/")) for url in ecfg.urls]
    if not replicas:
        replicas = (place or start_here)(launcher, ecfg.replicas)
    try:
        with ThreadPoolExecutor(len(replicas)) as pool:
            list(pool.map(lambda r: r.wait_ready(ecfg.startup_timeout_s), replicas))
    except BaseException:
        for r in replicas:
            if r.process is not None:
                r.process.stop()
        raise
    return ServerEngine(
        backend,
        replicas,
        eos_token_ids=eos_token_ids,
        max_model_len=max_len,
        seed=seed,
        weights_dir=Path(work_dir) / "weights",
        request_timeout_s=ecfg.request_timeout_s,
        model_dir=model_path,
    )
