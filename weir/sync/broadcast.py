"""Bucketed broadcast of full weights over a torch.distributed group of its own.

The group joins the trainer's rank 0 (root, group rank 0) and every engine (ranks 1..M). It is a
standalone process group built from a TCPStore, not torch's default group: the trainer ranks
already use that one for FSDP2, and the engines are not part of it. gloo on CPU, NCCL on GPU.

Tensors travel in buckets: consecutive tensors of one dtype are flattened into one buffer of at
most `bucket_bytes` (a larger tensor goes alone), so the number of collectives stays small and
the extra memory is one bucket.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

Tensor = torch.Tensor


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
) -> dist.ProcessGroup:
    """A process group built as SGLang builds its weight-update group (see `STYLES`)."""
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, size = next(rendezvous(f"tcp://{host}:{port}", rank, size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        size, rank, [], backend, PrefixStore(name, store), group_name=name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(size)}
    return pg


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
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._registered = style == "sglang"  # torch's registry holds it by name until destroyed
        if style == "sglang":
            self.pg = sglang_style_group(host, port, rank, size, backend, name, timeout)
            return
        self.store = dist.TCPStore(
            host, port, size, rank == 0, timeout=timeout, wait_for_workers=False
        )
        prefix = dist.PrefixStore(name, self.store)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefix, rank, size)
        else:
            self.pg = dist.ProcessGroupGloo(prefix, rank, size, timeout)

    def _broadcast(self, buf: Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([buf], opts).wait()

    def send(self, state: Mapping[str, Tensor], buckets: list[list[TensorMeta]]) -> int:
        """Root: broadcast `state` bucket by bucket; returns the bytes sent."""
        sent = 0
        for bucket in buckets:
            flat = torch.cat([state[m.name].detach().reshape(-1).to(self.device) for m in bucket])
            sent += self.send_flat(flat)
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
