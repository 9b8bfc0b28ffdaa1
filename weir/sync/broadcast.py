"""Bucketed broadcast of full weights over a torch.distributed group of its own.

The group joins the trainer's rank 0 (root, group rank 0) and every engine (ranks 1..M). It is a
standalone process group built from a TCPStore, not torch's default group: the trainer ranks
already use that one for FSDP2, and the engines are not part of it. gloo on CPU, NCCL on GPU.

Tensors travel in buckets: consecutive tensors of one dtype are flattened into one buffer of at
most `bucket_bytes` (a larger tensor goes alone), so the number of collectives stays small and
the extra memory is one bucket.

A member that dies half way leaves the others blocked in a collective that cannot finish (gloo
and NCCL pass a bucket along a tree). So every member waits for its collectives by polling, and
between polls looks for the group's abort key (`abort_key`) in rank 0's TCPStore: the driver sets
it when a member failed, and every member then aborts its side of the group and raises
`SyncAborted` within `ABORT_CHECK_S`, ready to join the next group. Forming a group waits the same
way (`form`): a member that never arrives would otherwise hold the others in the backend's
rendezvous until its timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

Tensor = torch.Tensor

log = logging.getLogger(__name__)

ABORT_CHECK_S = 0.25
"""How often a member waiting for a collective looks for its group's abort key (a TCPStore
round trip; the wait itself polls the collective without it)."""


ABORT_GRACE_S = 30.0
"""How long the driver gives the members of an aborted group to leave it; one still waiting then
counts as wedged (only a restart frees it)."""


class SyncAborted(RuntimeError):
    """The driver aborted the weight-broadcast group (a member failed): this member left it."""


def abort_key(name: str) -> str:
    """The key in rank 0's TCPStore (unprefixed) whose presence aborts group `name`."""
    return f"weir-abort/{name}"


def abandon(pg: dist.ProcessGroup, work: dist.Work) -> bool:
    """Leave `pg` after its collective `work` failed or was aborted: abort it where the backend
    can (NCCL: the kernel waiting on a member that is gone ends). A collective still pending
    after that (gloo cannot abort one in flight; it ends at the group's timeout) pins the group:
    destroying it would join the thread waiting in it, and so would the interpreter's exit, so
    the group is left allocated for the life of the process (one per failed sync). Returns
    whether it was pinned so."""
    abort = getattr(pg, "abort", None)
    if abort is not None:
        with contextlib.suppress(RuntimeError):
            abort()
    if work.is_completed():
        return False
    for obj in (pg, work):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    return True


def _client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A connection of its own to the TCPStore that rank 0 hosts at `host:port`, waiting up to
    `timeout_s` for it to open."""
    return dist.TCPStore(
        host,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def signal_abort(host: str, port: int, name: str, timeout_s: float = ABORT_GRACE_S) -> None:
    """Abort group `name`: set its key in the TCPStore that its rank 0 hosts at `host:port`
    (the driver's side; every member leaves the group within `ABORT_CHECK_S`). Waits up to
    `timeout_s` for the store: a member may fail to join before rank 0, busy with an earlier
    call, has opened it (the key then awaits rank 0's join). A warning if that store is gone
    with rank 0: its members' polls of it fail then, which ends them too."""
    try:
        _client(host, port, timeout_s).set(abort_key(name), "1")
    except Exception as err:
        log.warning("weight sync: could not set the abort key of %s: %s", name, err)


def finish(work: dist.Work, store: dist.Store, key: str) -> None:
    """Wait for a collective's `work`; `SyncAborted` if `key` appears in `store` first (then the
    collective may never finish: the caller aborts its process group).

    Polls: a yield of the thread for the first 5 ms (a bucket on NCCL takes about a millisecond,
    so a sleep would add its granularity to every bucket), then 0.5 ms sleeps; the store is asked
    every `ABORT_CHECK_S`."""
    start = time.monotonic()
    check = start + ABORT_CHECK_S
    while not work.is_completed():
        now = time.monotonic()
        if now >= check:
            if store.check([key]):
                raise SyncAborted(f"weight sync: group aborted by the driver ({key})")
            check = now + ABORT_CHECK_S
        time.sleep(0 if now - start < 0.005 else 0.0005)
    work.wait()  # raises the collective's error; on NCCL orders the current stream after it


T = TypeVar("T")


def form(make: Callable[[], T], host: str, port: int, key: str) -> T:
    """Build a process group by ``make()`` (it returns once every member has arrived) and return
    it; `SyncAborted` if `key` appears first in the TCPStore at `host:port` (rank 0's: the driver
    aborted the group, a member died or hangs before it joined).

    ``make`` runs in a daemon thread of its own, since the backends' rendezvous cannot be
    interrupted. After an abort that thread is left behind, holding a half-built group (never a
    collective) and, on rank 0, the group's TCPStore: gloo's rendezvous ends at the group's
    timeout; NCCL's blocking communicator set-up has no timeout of its own, so there the thread
    may stay for the life of the process. It does not hold up the process's exit. The key is
    looked for every `ABORT_CHECK_S` through a connection of its own: a TCPStore client serves one
    request at a time, and the rendezvous holds the group's in a blocking wait."""
    store = _client(host, port, ABORT_GRACE_S)
    done: dict[str, object] = {}

    def build() -> None:
        try:
            done["group"] = make()
        except BaseException as err:  # handed to the caller below
            done["error"] = err

    thread = threading.Thread(target=build, name=f"weir-form-{key}", daemon=True)
    thread.start()
    while True:
        thread.join(ABORT_CHECK_S)
        if not thread.is_alive():
            break
        if store.check([key]):
            raise SyncAborted(f"weight sync: group aborted by the driver while it formed ({key})")
    if "error" in done:
        raise done["error"]  # type: ignore[misc]
    return done["group"]  # type: ignore[return-value]


def eager_connect(pg: dist.ProcessGroup, device: torch.device) -> dist.ProcessGroup:
    """Create an NCCL group's communicator now, inside `form`'s abortable wait, instead of at its
    first collective (NCCL makes it lazily there, where a member that never came would hold the
    others in its bootstrap until the timeout). Other backends connect in their constructor."""
    connect = getattr(pg, "eager_connect_single_device", None)
    if device.type == "cuda" and connect is not None:
        connect(device)
    return pg


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to rebuild one tensor from a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.torch_dtype).element_size()

    @staticmethod
    def of(name: str, t: Tensor) -> TensorMeta:
        return TensorMeta(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Split `metas` (in order) into buckets of one dtype and at most `bucket_bytes` each."""
    buckets: list[list[TensorMeta]] = []
    size = 0
    for m in metas:
        last = buckets[-1] if buckets else None
        if last is None or last[0].dtype != m.dtype or size + m.nbytes > bucket_bytes:
            buckets.append([m])
            size = m.nbytes
        else:
            last.append(m)
            size += m.nbytes
    return buckets


STYLES = ("weir", "sglang")
"""How a group is built. ``weir``: a TCPStore at rank 0, prefixed by the group's name, and the
backend's process group on it (weir's engine workers and weir's vLLM worker extension build it so).
``sglang``: SGLang's ``init_custom_process_group`` (a ``tcp://`` rendezvous, the store prefixed by
the group name, torch's ``_new_process_group_helper``), which a server's
``/init_weights_update_group`` runs on its side: both ends must build the group the same way."""


def sglang_style_group(
    host: str, port: int, rank: int, size: int, backend: str, name: str, timeout
) -> tuple[dist.ProcessGroup, dist.Store]:
    """A process group built as SGLang builds its weight-update group (see `STYLES`), and the
    rendezvous's TCPStore (rank 0 hosts it).

    Rank 0 (weir's trainer) hosts the store without waiting for the others to connect, as the
    ``tcp://`` rendezvous's own master would, and builds its side in `form`: a server that never
    joins is then aborted by the driver like a member that dies later. The other ranks (SGLang's
    side, or a stand-in for it) join as SGLang does. On NCCL rank 0 cannot create its
    communicator eagerly (SGLang's side creates its own at the first bucket), so a server that
    joins and dies before the first bucket holds rank 0 in NCCL's set-up there, out of the
    abort's reach."""
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if rank == 0:
        store = dist.TCPStore(
            host, port, size, True, timeout=timeout, multi_tenant=True, wait_for_workers=False
        )
    else:
        store, rank, size = next(rendezvous(f"tcp://{host}:{port}", rank, size, timeout=timeout))
    store.set_timeout(timeout)

    def make() -> dist.ProcessGroup:
        pg, _ = _new_process_group_helper(
            size, rank, [], backend, PrefixStore(name, store), group_name=name, timeout=timeout
        )
        _world.pg_group_ranks[pg] = {i: i for i in range(size)}
        return pg

    return (form(make, host, port, abort_key(name)) if rank == 0 else make()), store


class BroadcastGroup:
    """One member of a weight-broadcast group (rank 0 sends, the others receive).

    Every member must construct it at about the same time (rendezvous through rank 0's TCPStore
    at `host:port`). `style` says how the group is built (`STYLES`); `per_tensor` sends a bucket
    as one broadcast per tensor instead of one of the flat buffer (SGLang receives so).
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        size: int,
        *,
        backend: str = "gloo",
        name: str = "weir-sync",
        timeout_s: float = 600.0,
        style: str = "weir",
        per_tensor: bool = False,
    ) -> None:
        if style not in STYLES:
            raise ValueError(f"BroadcastGroup: unknown style {style!r}; use one of {STYLES}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.size, self.backend = rank, size, backend
        self.per_tensor = per_tensor
        self.abort_key = abort_key(name)
        self._in_flight: dist.Work | None = None
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._registered = style == "sglang"  # torch's registry holds it by name until destroyed
        if style == "sglang":
            self.pg, self.store = sglang_style_group(host, port, rank, size, backend, name, timeout)
            return
        self.store = dist.TCPStore(
            host, port, size, rank == 0, timeout=timeout, wait_for_workers=False
        )
        prefix = dist.PrefixStore(name, self.store)

        def make() -> dist.ProcessGroup:
            if backend == "nccl":
                return eager_connect(dist.ProcessGroupNCCL(prefix, rank, size), self.device)
            return dist.ProcessGroupGloo(prefix, rank, size, timeout)

        self.pg = form(make, host, port, self.abort_key)

    def _broadcast(self, buf: Tensor) -> None:
        """One broadcast from rank 0; on an abort or an error this member leaves the group (it
        cannot be used again: the next sync forms a new one).

        Rank 0 on a GPU keeps one broadcast in flight: a plain NCCL wait (the current stream
        waits for it) lets the host go on to gather the next bucket, and the one before is
        waited for, abort key and all, when the next is sent (`drain` waits for the last)."""
        if self.pg is None:
            raise SyncAborted("weight sync: this member left its group after a failure")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work: dist.Work | None = self.pg.broadcast([buf], opts)
        if self.rank == 0 and buf.is_cuda:
            work.wait()
            work, self._in_flight = self._in_flight, work
        if work is not None:
            self._finish(work)

    def drain(self) -> None:
        """Root: wait for the broadcast still in flight (see `_broadcast`); call after the last."""
        work, self._in_flight = self._in_flight, None
        if work is not None:
            self._finish(work)

    def _finish(self, work: dist.Work) -> None:
        try:
            finish(work, self.store, self.abort_key)
        except Exception:
            pinned = abandon(self.pg, work)
            if self._registered and not pinned:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(self.pg)
            self.pg, self._in_flight = None, None
            raise

    def send(self, state: Mapping[str, Tensor], buckets: list[list[TensorMeta]]) -> int:
        """Root: broadcast `state` bucket by bucket; returns the bytes sent."""
        sent = 0
        for bucket in buckets:
            flat = torch.cat([state[m.name].detach().reshape(-1).to(self.device) for m in bucket])
            sent += self.send_flat(flat)
        self.drain()
        return sent

    def send_flat(self, flat: Tensor, bucket: list[TensorMeta] | None = None) -> int:
        """Root: broadcast one bucket's flat buffer (moved to the group's device if it is not
        there), whole, or with `per_tensor` one view per tensor of `bucket`; returns its bytes."""
        assert self.rank == 0, "only rank 0 sends"
        flat = flat if flat.device == self.device else flat.to(self.device)
        if self.per_tensor:
            if bucket is None:
                raise ValueError("a per-tensor group sends a bucket with its tensors' metas")
            for m, part in zip(bucket, flat.split([m.numel for m in bucket]), strict=True):
                self._broadcast(part.view(m.shape))
        else:
            self._broadcast(flat)
        return flat.numel() * flat.element_size()

    def close(self) -> None:
        """Let go of the process group (its connections close when the last reference goes; one
        built SGLang's way is also taken out of torch's registry of named groups)."""
        if self._registered and self.pg is not None:
            dist.destroy_process_group(self.pg)
        self.pg = None

    def recv(self, buckets: list[list[TensorMeta]]) -> dict[str, Tensor]:
        """Receiver: the tensors of every bucket, by name."""
        return dict(self.recv_stream(buckets))

    def recv_stream(self, buckets: list[list[TensorMeta]]) -> Iterator[tuple[str, Tensor]]:
        """Receiver: (name, tensor) of each bucket as it arrives; the tensors are views of the
        bucket's buffer, which is received only when the previous bucket's tensors were consumed,
        so a consumer that copies them and lets go holds one bucket at a time."""
        assert self.rank != 0, "rank 0 sends"
        for bucket in buckets:
            flat = torch.empty(
                sum(m.numel for m in bucket), dtype=bucket[0].torch_dtype, device=self.device
            )
            self._broadcast(flat)
            for m, part in zip(bucket, flat.split([m.numel for m in bucket]), strict=True):
                yield m.name, part.view(m.shape)
            del flat, part
