"""Build the server engine that `engine.type` names (vllm or sglang) from the `engine` config section."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from weir.engine.server_engine import ServerBackend, ServerEngine
from weir.engine.servers import Replica, ServerProcess, free_port


def start_engine_servers(
    ecfg: Any,
    model_path: str,
    work_dir: str | Path,
    eos_token_ids: list[int],
    *,
    dtype: str,
    seed: int,
) -> ServerEngine:
    """Start (or attach to) the servers of `ecfg` (an `EngineConfig`): logs and the weights the
    servers load live under `work_dir`."""
    if ecfg.type == "vllm":
        from weir.engine.vllm_engine import start_vllm

        engine = start_vllm(
            ecfg, model_path, work_dir, eos_token_ids=eos_token_ids, dtype=dtype, seed=seed
        )
    elif ecfg.type == "sglang":
        from weir.engine.sglang_engine import start_sglang

        engine = start_sglang(
            ecfg, model_path, work_dir, eos_token_ids=eos_token_ids, dtype=dtype, seed=seed
        )
    else:
        raise ValueError(f"engine.type={ecfg.type!r} is not a server engine (vllm or sglang)")
    engine.sleep_mode = bool(ecfg.sleep_mode)
    return engine


def launch_servers(
    backend: ServerBackend,
    ecfg: Any,
    model_path: str,
    work_dir: str | Path,
    make_process: Callable[[int, int], ServerProcess],
    *,
    eos_token_ids: list[int],
    max_len: int,
    seed: int,
) -> ServerEngine:
    """Attach to ``ecfg.urls``, or start ``ecfg.replicas`` servers (``make_process(index, port)``)
    in parallel; wait until every one answers its health check (if one does not, the others are
    stopped and the error names the log it wrote); return the engine over them."""
    replicas = [Replica(url.rstrip("/")) for url in ecfg.urls]
    if not replicas:
        for i in range(ecfg.replicas):
            proc = make_process(i, free_port())
            replicas.append(Replica(proc.url, proc))
        for r in replicas:
            r.process.start()
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
