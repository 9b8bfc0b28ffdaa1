"""`weir serve MODEL`: load a model into the built-in engine and serve it until interrupted."""

from __future__ import annotations

import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from weir.config import Config
from weir.engine.kv_budget import kv_options


def run_server(
    cfg: Config,
    *,
    admin_key: str | None = None,
    on_start: Callable[[object], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve ``cfg.model.path`` with ``cfg.serve`` settings until `stop` is set, Ctrl-C or SIGTERM.

    `on_start(server)` is called once the server accepts requests (the CLI prints the address).
    """
    import torch

    from weir.engine.torch_engine import TorchEngine
    from weir.serve.server import Server
    from weir.train.model import eos_token_ids, load_model, resolve_model_path

    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    build_dir = Path(tempfile.gettempdir()) / "weir-models"
    path = resolve_model_path(
        cfg.model.path, build_dir, arch=cfg.model.arch, seed=cfg.model.init_seed
    )
    from weir.config.devices import resolve_device, resolve_dtype

    device = resolve_device(cfg.engine.device, key="engine.device")
    model, tokenizer = load_model(path, resolve_dtype(cfg.engine.dtype, device), device)
    model.eval()
    engine = TorchEngine(
        model,
        eos_token_ids=eos_token_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        max_batch_size=cfg.engine.max_batch_size,
        seed=cfg.run.seed,
        **kv_options(cfg.engine),
    )
    name = cfg.serve.model_name or Path(cfg.model.path.rstrip("/")).name
    stop = stop or threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM stops it like Ctrl-C
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with Server(
            engine,
            tokenizer,
            cfg.serve,
            model_name=name,
            admin_key=admin_key,
            allow_remote_images=cfg.vision.allow_remote_urls,
        ) as server:
            if on_start is not None:
                on_start(server)
            try:
                while not stop.wait(0.5):
                    pass
            except KeyboardInterrupt:
                pass
    finally:
        engine.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
