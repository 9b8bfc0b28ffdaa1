"""`Server`: the OpenAI-compatible app on uvicorn, in a background thread of this process.

Tests, the trainer and notebooks use it in-process:

    with Server(engine, tokenizer) as server:          # binds 127.0.0.1 on a free port
        session = server.sessions.open(row)
        client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key)
        ...
        sample = session.to_sample()
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any

import uvicorn

from weir.config.schema import ServeConfig
from weir.engine.base import Engine
from weir.serve.app import BodyLimit, ServerState, create_app
from weir.serve.sessions import SessionManager

log = logging.getLogger("weir.serve")


def engine_stop_ids(engine: Engine, tokenizer: Any) -> list[int]:
    """The ids that end an assistant turn: the engine's EOS ids, else the tokenizer's eos."""
    ids = list(getattr(engine, "eos_token_ids", None) or [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return [int(i) for i in ids]


class Server:
    """Serve `engine` (any weir `Engine`) with `tokenizer`'s chat template until `stop()`.

    `config` sets the address and the request limits (default: 127.0.0.1, a free port);
    `admin_key` may open sessions over HTTP and make unrecorded calls (random when None).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        config: ServeConfig | None = None,
        *,
        model_name: str = "weir",
        admin_key: str | None = None,
        allow_remote_images: bool = False,
    ):
        self.config = config or ServeConfig()
        self.sessions = SessionManager(admin_key=admin_key)
        self.state = ServerState(
            engine,
            tokenizer,
            self.config,
            self.sessions,
            self.config.model_name or model_name,
            engine_stop_ids(engine, tokenizer),
            allow_remote_images=allow_remote_images,
        )
        self.app = BodyLimit(create_app(self.state), self.config.max_body_bytes)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.host = self.config.host
        self.port = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``."""
        return self.url + "/v1"

    def start(self, timeout: float = 30.0) -> Server:
        """Bind the socket, start uvicorn in a daemon thread, and return once it accepts requests."""
        if self._thread is not None:
            return self
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.config.port))
        except OSError as err:
            sock.close()
            raise ValueError(
                f"serve: cannot listen on {self.host}:{self.config.port} ({err}); choose another "
                "serve.port (0 picks a free one) or serve.host"
            ) from None
        self._socket = sock
        self.port = sock.getsockname()[1]
        self.sessions.base_url = self.base_url
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._run, name=f"weir-serve-{self.port}", daemon=True
        )
        self._thread.start()
        waited = 0.0
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the weir server thread exited during start-up (see the log)")
            if waited > timeout:
                raise TimeoutError(f"the weir server did not start within {timeout} s")
            threading.Event().wait(0.01)
            waited += 0.01
        return self

    def _run(self) -> None:
        assert self._server is not None and self._socket is not None
        asyncio.run(self._server.serve(sockets=[self._socket]))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting requests and end the thread (requests in flight finish first)."""
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = self._socket = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
