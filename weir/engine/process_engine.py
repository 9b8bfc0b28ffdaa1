"""The built-in engine in a child process of its own (`engine.process=true`).

In `loop.mode=async` the trainer and the engine run at once. In one process they are two threads,
and every Python step of either (the engine's scheduling and sampling bookkeeping, the trainer's
micro-batch loop, the rollout's reward code) waits for the other's to release the GIL. Here the
`TorchEngine` runs in a child process; the parent keeps a proxy that speaks the
`Engine` protocol and the blocking control API the loop uses (``*_sync``, ``stats``, checkpoint
state), so the loop, the rollouts and the checks do not know the difference.

Start: a model on CUDA gets a ``spawn``ed child (a fresh interpreter: CUDA cannot be used in a
forked one). A model on a CPU gets a child forked from multiprocessing's fork server, which
imports torch, transformers and the engine once (`PRELOAD`) and forks every later child from
there: a child is ready in about a second instead of the seconds a fresh interpreter spends
importing them (a run's second replica, an engine restarted after it died, every run of a
process that makes many). The fork server imports nothing that starts a thread or touches a
device. The child sets the parent's `os.environ` as it is when the engine is made; what a library
read from the environment when the fork server imported it (``HF_HOME``, ``TORCH_LOGS``) keeps
the fork server's value. A CPU model of more than `FORKSERVER_MAX_STORAGES` tensors (a real 0.5B
model has about 290) cannot be handed to a forked child, and its child is spawned.

Transport: one `multiprocessing` pipe. A call is ``(call_id, method, args)``; the child answers
``(call_id, ok, value)``. Generation calls are answered when their request ends, so many are in
flight at once and the child batches them as in one process. Blocking control calls (update,
pause, drain, ...) run in order in one worker thread of the child, so the pipe keeps being read
while one waits.

Weights: the parent allocates, once per tensor name, a buffer on the engine's device in the engine's
dtype (shared memory on a CPU; a CUDA tensor is passed by IPC handle) and sends it to the child
with the first update; every update then copies the trainer's tensors into those buffers and asks
the child to load them, which it does between decode steps, as `TorchEngine.update_weights_sync`
does for a trainer in the same process. The parent waits for the child's answer before it touches
a buffer again, so the child never reads a half-written update.

Settings: the child starts with torch's defaults, so it takes this process's torch backend settings
as they are when the engine is made (`weir.config.devices.backend_flags`: TF32, the attention
backends, deterministic algorithms) and its thread count; on CUDA the engine in a process then runs
the kernels and numbers the engine in a thread would.

Failure: if the child dies, every call in flight and every later call fails with
`EngineProcessDied`, naming its exit code; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import itertools
import logging
import os
import sys
import threading
import traceback
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from weir.config.devices import apply_backend_flags, backend_flags
from weir.engine.base import Completion, FromSubmitMany, SamplingParams, SyncControl

log = logging.getLogger(__name__)

PRELOAD = ["weir.engine.process_engine", "weir.engine.torch_engine"]
"""What the fork server imports before it forks children (see the module docstring)."""
CLOSE_TIMEOUT_S = 8.0  # the child's own bound on stopping
STOP_WAIT_S = CLOSE_TIMEOUT_S + 2  # how long the parent waits for it before terminating it

# The blocking methods of `TorchEngine` a parent may call (they run in the child's control thread).
_CONTROL = frozenset(
    {
        "pause_sync",
        "resume_sync",
        "abort_sync",
        "drain_sync",
        "sleep_sync",
        "wake_sync",
        "check_fits",
        "stats",
        "state_dict",
        "load_state_dict",
    }
)


class EngineProcessDied(RuntimeError):
    """The engine's child process exited while calls were in flight, or before a call."""


FORKSERVER_MAX_STORAGES = 200
"""The most tensor storages a model may have to reach a forked child: each goes as one file
descriptor, and the fork server refuses a child that would take 256 or more (Python's
`multiprocessing.forkserver.MAXFDS_TO_SEND`); a larger model's child is spawned."""


def start_method(model: torch.nn.Module) -> str:
    """How the child of an engine on `model` starts: ``spawn`` when any of its tensors is on CUDA
    or it has more tensor storages than a forked child can be handed (`FORKSERVER_MAX_STORAGES`),
    else ``forkserver``."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_cuda for t in tensors):
        return "spawn"
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    return "forkserver" if len(storages) <= FORKSERVER_MAX_STORAGES else "spawn"


def _context(model: torch.nn.Module) -> Any:
    method = start_method(model)
    ctx = torch.multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child_main(
    conn: Any,
    model: torch.nn.Module,
    kwargs: dict,
    num_threads: int | None,
    backends: dict,
    environ: dict[str, str],
) -> None:
    """The child: build the `TorchEngine` on `model` and serve calls from `conn` until "close"."""
    warm = "weir.engine.torch_engine" in sys.modules
    os.environ.clear()
    os.environ.update(environ)  # a forked child has the fork server's, from when it started
    from weir.engine.torch_engine import TorchEngine

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    apply_backend_flags(backends)
    send_lock = threading.Lock()

    def reply(call_id: int, ok: bool, value: Any) -> None:
        with send_lock:
            conn.send((call_id, ok, value))

    try:
        _own_storage(model)
        engine = TorchEngine(model.eval(), num_threads=num_threads, **kwargs)
    except BaseException as exc:  # e.g. UnsupportedModel, a KV budget that cannot be met
        reply(0, False, _portable(exc))
        return
    reply(0, True, {**_describe(engine), "preloaded": warm})
    buffers: dict[str, torch.Tensor] = {}
    control = ThreadPoolExecutor(1, thread_name_prefix="weir-engine-control")

    def answer_future(call_id: int, fut: Future) -> None:
        exc = fut.exception()
        reply(call_id, exc is None, fut.result() if exc is None else _portable(exc))

    def run_control(call_id: int, method: str, args: tuple) -> None:
        try:
            if method == "update_weights":
                new, names, version = args
                buffers.update(new)
                engine.update_weights_sync(((n, buffers[n]) for n in names), version)
                value: Any = engine.version
            else:
                value = getattr(engine, method)(*args)
            reply(call_id, True, value)
        except BaseException as exc:
            reply(call_id, False, _portable(exc))

    try:
        while True:
            try:
                call_id, method, args = conn.recv()
            except EOFError:  # the parent is gone
                break
            if method == "submit_many":
                prompts, params = args
                try:
                    futures = engine.submit_many(prompts, params)
                except Exception as exc:  # one error for each prompt of the call
                    for i in range(len(prompts)):
                        reply(call_id + i, False, _portable(exc))
                    continue
                for i, fut in enumerate(futures):
                    fut.add_done_callback(lambda f, c=call_id + i: answer_future(c, f))
            elif method == "close":
                break
            elif method == "getenv":
                reply(call_id, True, os.environ.get(*args))
            elif method == "update_weights" or method in _CONTROL:
                control.submit(run_control, call_id, method, args)
            else:
                reply(call_id, False, AttributeError(f"the engine process has no call {method!r}"))
    finally:
        # a stop that hangs shows where, in the run's log, and does not outlive the parent's wait
        faulthandler.dump_traceback_later(CLOSE_TIMEOUT_S, exit=True)
        engine.close()
        control.shutdown(wait=True)
        reply(-1, True, None)
        conn.close()
        # skip the interpreter's teardown of torch and transformers (a second or more): nothing of
        # the child's needs it, its shared buffers are the parent's
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@torch.no_grad()
def _own_storage(model: torch.nn.Module) -> None:
    """Give the child its own copy of every tensor it received. They arrive in memory the parent
    holds (shared memory, or a CUDA IPC mapping that is valid only while the parent keeps the
    tensor alive); the parent lets go of its copy once the child reports ready."""
    for t in [*model.parameters(), *model.buffers()]:
        t.data = t.data.clone()


def _describe(engine: Any) -> dict[str, Any]:
    """What the parent's proxy mirrors of a started engine."""
    return {
        "version": engine.version,
        "vocab_size": engine.vocab_size,
        "max_seq_len": engine.max_seq_len,
        "max_batch_size": engine.max_batch_size,
        "eos_token_ids": list(engine.eos_token_ids),
        "pad_token_id": engine.pad_token_id,
        "dtype": engine.dtype,
        "device": str(engine.device),
        "backends": backend_flags(),
    }


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it pickles, else a RuntimeError with its type, message and traceback."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        text = "".join(traceback.format_exception(exc))
        return RuntimeError(f"{type(exc).__name__}: {exc}\n(in the engine process)\n{text}")


class ProcessEngine(FromSubmitMany, SyncControl):
    """A `TorchEngine` on `model` in a child process (see the module docstring).

    Args:
        model: the engine's own model (not the trainer's: its tensors are moved to shared memory,
            or shared by CUDA IPC, to reach the child, which copies them before it reports ready;
            the caller may then drop or change it). Built-in engine architectures only, as for
            `TorchEngine`.
        num_threads: torch threads of the child (its whole process); None: this process's
            current setting, as a `TorchEngine` in a thread would inherit it.
        start_timeout_s: how long to wait for the child to import torch and build the engine.
        **engine_kwargs: `TorchEngine` keyword arguments (eos_token_ids, pad_token_id, seed, KV
            options, ...).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_threads: int | None = 1,
        start_timeout_s: float = 300.0,
        **engine_kwargs: Any,
    ) -> None:
        if num_threads is None:
            num_threads = torch.get_num_threads()
        ctx = _context(model)
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child_main,
            args=(child_conn, model, engine_kwargs, num_threads, backend_flags(), dict(os.environ)),
            name="weir-engine",
            daemon=True,
        )
        self._send_lock = threading.Lock()
        self._mu = threading.Lock()
        self._calls: dict[int, Future] = {0: Future()}
        self._ids = itertools.count(1)
        self._dead: EngineProcessDied | None = None
        self._closed = False
        self._buffers: dict[str, torch.Tensor] = {}
        self._update_lock = threading.Lock()
        self._join_lock = threading.Lock()
        self._proc.start()
        child_conn.close()
        self._reader = threading.Thread(target=self._read, name="weir-engine-reader", daemon=True)
        self._reader.start()
        try:
            info = self._calls[0].result(timeout=start_timeout_s)
        except BaseException:
            self._stop_process()
            raise
        self.version: int = info["version"]
        self.vocab_size: int = info["vocab_size"]
        self.max_seq_len: int = info["max_seq_len"]
        self.max_batch_size: int = info["max_batch_size"]
        self.eos_token_ids: list[int] = info["eos_token_ids"]
        self.pad_token_id: int = info["pad_token_id"]
        self.dtype: torch.dtype = info["dtype"]
        self.device = torch.device(info["device"])
        self.backends: dict[str, Any] = info["backends"]  # the child's, as `backend_flags` reads
        self.preloaded: bool = info["preloaded"]
        """The child found the engine's modules imported (forked from the fork server)."""

    # -- transport ---------------------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            if call_id == -1:
                break
            with self._mu:
                fut = self._calls.pop(call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)
        self._join(5)
        died = EngineProcessDied(
            f"the engine process (pid {self._proc.pid}) exited with code {self._proc.exitcode}"
            + ("" if self._closed else "; see the log above for its error")
        )
        with self._mu:
            self._dead = died
            pending, self._calls = list(self._calls.values()), {}
        for fut in pending:
            if not fut.done():
                fut.set_exception(died)

    def _send(self, method: str, args: tuple, count: int = 1) -> list[Future]:
        futures = [Future() for _ in range(count)]
        with self._send_lock:
            with self._mu:
                if self._dead is not None:
                    raise self._dead
                call_id = next(self._ids)
                for _ in range(count - 1):
                    next(self._ids)
                for i, fut in enumerate(futures):
                    self._calls[call_id + i] = fut
            self._conn.send((call_id, method, args))
        return futures

    def _call(self, method: str, *args: Any) -> Any:
        return self._send(method, args)[0].result()

    def child_getenv(self, name: str) -> str | None:
        """The environment variable `name` as the engine's process sees it."""
        return self._call("getenv", name)

    # -- generation --------------------------------------------------------------------------------

    def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Future[list[Completion]]]:
        """As `TorchEngine.submit_many`: one future per prompt, admitted together."""
        if params is not None and not isinstance(params, SamplingParams):
            params = list(params)
        prompts = [[int(t) for t in p] for p in prompts]
        return self._send("submit_many", (prompts, params), count=len(prompts))

    # -- weights -----------------------------------------------------------------------------------

    def update_weights_sync(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Copy `named_tensors` into the shared buffers and have the child load them between
        decode steps; returns once it has (then `version` is set)."""
        with self._update_lock, torch.no_grad():
            new: dict[str, torch.Tensor] = {}
            names: list[str] = []
            for name, tensor in named_tensors:
                buf = self._buffers.get(name)
                if buf is None or buf.shape != tensor.shape:
                    buf = torch.empty(tensor.shape, dtype=self.dtype, device=self.device)
                    if buf.device.type == "cpu":
                        buf.share_memory_()
                    self._buffers[name] = new[name] = buf
                buf.copy_(tensor.detach())
                names.append(name)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.version = self._call("update_weights", new, names, version)

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        await asyncio.to_thread(self.update_weights_sync, named_tensors, version)

    # -- control (blocking, as on TorchEngine) -----------------------------------------------------

    def pause_sync(self) -> None:
        self._call("pause_sync")

    def resume_sync(self) -> None:
        self._call("resume_sync")

    def abort_sync(self) -> None:
        self._call("abort_sync")

    def drain_sync(self, timeout: float | None = None) -> bool:
        return self._call("drain_sync", timeout)

    def sleep_sync(self, offload_weights: bool = False) -> None:
        self._call("sleep_sync", offload_weights)

    def wake_sync(self, update_follows: bool = False) -> None:
        self._call("wake_sync", update_follows)

    def check_fits(self, prompt_len: int, n: int, max_new_tokens: int) -> None:
        self._call("check_fits", prompt_len, n, max_new_tokens)

    def stats(self) -> dict[str, float]:
        return self._call("stats")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)
        self.version = state["version"]

    # -- lifetime ----------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def close(self, timeout: float | None = STOP_WAIT_S) -> None:
        """Abort what is in flight, stop the child and wait for it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(EngineProcessDied, OSError):
            self._send("close", ())
        self._stop_process(timeout)

    stop = close

    def _join(self, timeout: float | None) -> None:
        # one thread at a time: two joining at once race to reap the child, and the loser would
        # see it alive with no exit code
        with self._join_lock:
            self._proc.join(timeout)

    def _stop_process(self, timeout: float | None = STOP_WAIT_S) -> None:
        self._join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop in %s s; terminating it", timeout)
            self._proc.terminate()
            self._proc.join(5)
        self._reader.join(5)
        self._conn.close()

    def __enter__(self) -> ProcessEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
