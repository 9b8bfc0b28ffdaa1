"""Build the server engine that `engine.type` names (vllm or sglang) from the `engine` config section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weir.engine.server_engine import ServerEngine


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
