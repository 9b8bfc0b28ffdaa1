"""Weights from the trainer's FSDP2 shards into engine servers (vLLM, SGLang), bucket by bucket.

The servers run in processes (and Python environments) of their own, wherever the cluster placed
them (`weir.engine.server_host`) or attached by URL. A sync is one torch.distributed group spanning
trainer rank 0 (the root) and every worker of every server (a server with tensor parallelism
contributes each of its ranks): NCCL on GPUs, gloo on CPUs, built by the same code.

1. every trainer rank takes part in gathering each bucket from the shards (`SyncTrainerRank.stream`,
   each tensor cast to the engines' dtype before it travels); rank 0 broadcasts the bucket and
   lets go of it before the next;
2. each server receives through its own side of the protocol (`VllmBackend.receive_broadcast`:
   weir's worker extension loads each bucket as it arrives; `SglangBackend.receive_broadcast`:
   ``/update_weights_from_distributed`` per bucket), so a server worker holds its weights and one
   bucket, never a second copy of the model;
3. the engine pauses its requests before the first bucket and resumes them after the last, with
   the version stamped in between (`ServerEngine.update_with_sync`): tokens before carry the old
   version, tokens after the new one.

``disk`` instead: rank 0 gathers the full weights and writes a versioned safetensors directory the
servers read (servers outside the job's network, or without a common one for collectives).

A server that died and was restarted is given the current version streamed from the shards as long
as the trainer has not trained since the last push; otherwise it waits out of the routing and the
next push includes it.

A server that dies *during* a broadcast leaves the others waiting for buckets that cannot come
(the collective passes them along a tree). The driver sees the failure (the dead server's request
or rank 0's send fails), sets the group's abort key in rank 0's TCPStore, and every member leaves
the group within a quarter of a second (`weir.sync.broadcast.finish`); `DeliveryFailed` then
tells the engine, which restarts the dead server and has the update go again to the others in a
new group (`ServerEngine.update_with_sync`). A server whose side cannot be aborted (SGLang's own
receiving endpoint) and is still waiting `ABORT_GRACE_S` later is named `wedged`: the engine
restarts it too. The same holds while the group forms: a server whose join fails aborts it (rank
0 and weir's own members wait for the others by polling the abort key, `weir.sync.broadcast
.form`).

A server whose host vanishes without a TCP reset (power, network partition) fails no request:
its connections stay open and nothing answers. So while a group forms and while the weights
travel (also in `restore`), the driver asks every server a cheap GET (`liveness_path`: vLLM's
/health, SGLang's /get_model_info, which its HTTP process answers while its scheduler is busy)
every `LIVENESS_PERIOD_S`; one that fails `LIVENESS_MISSES` checks in a row counts as failed
(`ServerUnresponsive`), and the group is aborted as above. It tells a host or HTTP process that is
gone; a hung worker behind a live HTTP process answers it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from weir.engine.server_recovery import WeightsNotReady
from weir.sync.broadcast import ABORT_GRACE_S, TensorMeta, plan_buckets, signal_abort

log = logging.getLogger(__name__)

SERVER_TRANSPORTS = ("broadcast", "disk", "adapter")


_GROUPS = itertools.count()
"""Numbers the broadcast groups of this process: a group's name is taken once (torch keeps the
names of groups built SGLang's way, and two syncs of one process may each form groups)."""


LIVENESS_PERIOD_S = 5.0
"""How often a weight update checks that each of its servers answers (`ServerSync._liveness`),
and how long each answer may take."""

LIVENESS_MISSES = 3
"""Failed liveness checks in a row after which a weight update counts a server as lost (a host
gone without a TCP reset): each unanswered check waits out its `LIVENESS_PERIOD_S`, so that is
20-30 s after it went, with the defaults."""


class ServerUnresponsive(RuntimeError):
    """A server of a weight update stopped answering its liveness check (`LIVENESS_MISSES` in a
    row)."""


class DeliveryFailed(RuntimeError):
    """A broadcast failed half way and its group was aborted. `wedged`: the URLs of servers still
    waiting in it after `ABORT_GRACE_S` (they need a restart to take weights again)."""

    def __init__(self, message: str, wedged: frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        self.wedged = wedged


class ServerSync:
    """Publishes the trainer's weights to a `ServerEngine`'s servers.

    Args:
        trainer: a `TrainerGroup` of `SyncTrainerRank` actors.
        engine: the `ServerEngine` over the servers (its `restore` becomes this object's).
        transport: ``broadcast`` (the group above), ``disk``, or ``adapter`` (lora.sync=adapter:
            the LoRA adapter alone, written by rank 0 under `disk_dir`, loaded by each server's
            LoRA endpoint).
        bucket_mb: bucket size.
        backend: ``gloo`` or ``nccl``.
        dtype: the servers' weight dtype (e.g. "bfloat16"); floating tensors are cast to it on the
            trainer's device before they travel.
        disk_dir: the disk transport's directory (the servers must read it).
        model_dir: the model's directory, whose config files the disk transport copies next to
            the weights (SGLang's loader reads config.json there).
        verify: the servers record a digest of each update's tensors (`digests`), to compare with
            the trainer's (`SyncTrainerRank.weights_digest`); costs a hash of every tensor.
        role: the policy these servers run (multi_agent.policies=separate), "" for the one.
    """

    def __init__(
        self,
        trainer: Any,
        engine: Any,
        transport: str = "broadcast",
        *,
        bucket_mb: float = 64.0,
        backend: str = "gloo",
        dtype: str | None = None,
        disk_dir: str | Path | None = None,
        model_dir: str | Path | None = None,
        verify: bool = False,
        role: str = "",
    ) -> None:
        self.role = role
        if transport not in SERVER_TRANSPORTS:
            raise ValueError(
                f"cluster.weight_sync={transport} with engine.type={engine.backend.name}: servers "
                f"take weights by {' or '.join(SERVER_TRANSPORTS)}"
            )
        if transport in ("disk", "adapter") and disk_dir is None:
            raise ValueError(f"the {transport} transport needs a directory (cluster.sync_dir)")
        self.trainer, self.engine, self.transport = trainer, engine, transport
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.backend, self.dtype, self.verify = backend, dtype, verify
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.version = engine.version
        self._buckets: list[list[TensorMeta]] | None = None
        self._members: tuple[str, ...] | None = None  # the servers (urls) in the current group
        self._address: tuple[str, int] | None = None  # rank 0's TCPStore of the current group
        self._name = ""
        self._pushed = False
        self._trained_at_push = 0
        self._lock = threading.Lock()
        self._adapter: tuple[str, str] | None = None  # the adapter pushed last: (path, name)
        engine.verify_loads = verify  # a worker digests what it loads from disk too
        if transport != "disk":
            engine.restore = self.restore

    # -- pushes ------------------------------------------------------------------------------------

    def push(self, version: int) -> dict[str, float]:
        """Deliver the trainer's current weights to every server as `version`; returns timings."""
        with self._lock:
            start = time.perf_counter()
            if self.transport == "disk":
                nbytes = self._disk(version)
            elif self.transport == "adapter":
                nbytes = self._adapter_push(version)
            else:
                nbytes = self._stream(version)
            self._pushed = True
            self._trained_at_push = getattr(self.trainer, "trained", 0)
            self.version = version
            end = time.perf_counter()
            checked = {"sync/verified": self.check(version)} if self.verify else {}
        return {
            **checked,
            "time/sync": end - start,
            "sync/mb": nbytes / 2**20,
            "sync/mb_per_s": nbytes / 2**20 / max(end - start, 1e-9),
            "cluster/engine_retries": float(self.engine.retries),
            "cluster/engine_restarts": float(self.engine.restarts),
            "cluster/sync_retries": float(self.engine.update_retries),
        }

    def _layout(self) -> list[list[TensorMeta]]:
        if self._buckets is None:
            metas = self.trainer.get([self.trainer.rank0.layout.remote(self.dtype, self.role)])[0]
            self._buckets = plan_buckets(metas, self.bucket_bytes)
        return self._buckets

    def _stream(self, version: int) -> int:
        sent = [0]

        async def load(replicas: list[tuple[int, Any]]) -> None:
            sent[0] = await self._deliver([r.url for _, r in replicas], version)

        self.engine.update_with_sync(load, version)
        return sent[0]

    async def _deliver(self, urls: list[str], version: int) -> int:
        """In the engine's loop: the group over `urls` (re-formed if they changed), every bucket
        from the shards to them, prefix caches dropped. Returns the bytes rank 0 sent.
        `DeliveryFailed` if a member failed half way (the group aborted, see the module
        docstring)."""
        if not urls:
            return 0
        await self._form_group(urls)
        receiving = self._receive(urls)
        sending = asyncio.ensure_future(asyncio.to_thread(self._send, version))
        await self._watched(urls, sending, receiving)
        await self._reset_caches(urls)
        return sending.result()

    async def _watched(
        self, urls: list[str], root: asyncio.Future, servers: list[asyncio.Future]
    ) -> None:
        """Wait for rank 0's side (`root`) and the servers' (`servers`, one per URL) of the
        current group. At the first failure, or a server that stops answering (`_liveness`), the
        group is aborted (`_abort`: `DeliveryFailed`). Cancelled: the members leave the group."""
        watch = asyncio.ensure_future(self._liveness(urls))
        everyone = [*servers, root]  # a server's failure is the cause rather than its echo at 0
        cause: BaseException | None = None
        try:
            while cause is None and not all(t.done() for t in everyone):
                waiting = [t for t in [*everyone, watch] if not t.done()]
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                failed = [t for t in everyone if t.done() and _failure(t) is not None]
                if not failed and watch.done() and not all(t.done() for t in everyone):
                    failed = [watch]  # a late check after every member finished counts for nothing
                cause = _failure(failed[0]) if failed else None
        except BaseException:  # cancelled: the members must not stay in a broadcast
            await self._cancel(servers)
            raise
        finally:
            watch.cancel()
        if cause is not None:
            await self._abort(urls, root, servers, cause)

    async def _liveness(self, urls: list[str]) -> None:
        """Raise `ServerUnresponsive` once a server at `urls` has failed `LIVENESS_MISSES` checks
        in a row (one every `LIVENESS_PERIOD_S`, each given as long): a GET of the backend's
        `liveness_path`, which its HTTP process answers while its workers load."""
        from weir.engine.servers import http_ok

        path = self.engine.backend.liveness_path
        misses = dict.fromkeys(urls, 0)
        while True:
            await asyncio.sleep(LIVENESS_PERIOD_S)
            answers = await asyncio.gather(
                *(asyncio.to_thread(http_ok, u + path, LIVENESS_PERIOD_S) for u in urls)
            )
            for url, answered in zip(urls, answers, strict=True):
                misses[url] = 0 if answered else misses[url] + 1
                if misses[url] >= LIVENESS_MISSES:
                    raise ServerUnresponsive(
                        f"{self.engine.backend.name} server {url} failed {LIVENESS_MISSES} "
                        f"checks of {path} in a row (no 2xx answer within "
                        f"{LIVENESS_PERIOD_S:g} s) during a weight update"
                    )

    async def _abort(
        self,
        urls: list[str],
        root: asyncio.Future,
        servers: list[asyncio.Future],
        cause: BaseException,
    ) -> None:
        """Abort the current group after `cause` (a member failed or stopped answering): set its
        abort key, give every member `ABORT_GRACE_S` to leave, cancel the requests of those still
        in it, raise `DeliveryFailed` naming them, from `cause`. A trainer rank that died is
        raised as it is (`TrainerFailed`: the run stops on it)."""
        from weir.cluster.ray_cluster import TrainerFailed

        self._members = None
        await asyncio.to_thread(self._signal_abort)
        _, pending = await asyncio.wait([root, *servers], timeout=ABORT_GRACE_S)
        wedged = frozenset(u for u, t in zip(urls, servers, strict=True) if t in pending)
        for t in pending:
            t.cancel()
        if root.done() and not root.cancelled() and isinstance(root.exception(), TrainerFailed):
            raise root.exception()
        raise DeliveryFailed(
            f"weight sync: a member of group {self._name} failed ({cause!r}); the group was "
            f"aborted" + (f", servers still in it: {sorted(wedged)}" if wedged else ""),
            wedged,
        ) from cause

    def _signal_abort(self, group: tuple[tuple[str, int] | None, str] | None = None) -> None:
        """Set the abort key of `group` ((rank 0's store address, name); the current group by
        default) in trainer rank 0's TCPStore (`weir.sync.broadcast.signal_abort`)."""
        address, name = group if group is not None else (self._address, self._name)
        if address is not None:
            signal_abort(*address, name)

    def _receive(self, urls: list[str]) -> list[asyncio.Future]:
        """In the engine's loop: every server at `urls` starts receiving the buckets. One whose
        request fails sets the group's abort key at once: rank 0 may be sending in a thread
        that nothing else watches (`restore`)."""
        backend, client, buckets = self.engine.backend, self.engine._client, self._layout()
        tasks = [
            asyncio.ensure_future(
                backend.receive_broadcast(client, url, buckets, self._name, self.verify)
            )
            for url in urls
        ]
        for task in tasks:
            self._abort_when_failed(task)
        return tasks

    def _abort_when_failed(self, task: asyncio.Future) -> None:
        """Set the current group's abort key (this group's, not the one a retry forms later)
        as soon as `task` fails."""
        group = (self._address, self._name)

        def abort_on_failure(task: asyncio.Future) -> None:
            if _failure(task) is not None:
                threading.Thread(target=self._signal_abort, args=(group,), daemon=True).start()

        task.add_done_callback(abort_on_failure)

    def _send(self, version: int) -> int:
        """Collective over the trainer ranks (blocking): every bucket gathered and broadcast;
        returns the bytes rank 0 sent (`SyncTrainerRank.stream` also times its offload)."""
        buckets = self._layout()
        sent = self.trainer.collective(
            lambda r, rank: rank.stream.remote(buckets, [], version, self.role)
        )
        nbytes, _offload_s = sent[0]
        return int(nbytes)

    def _abandon(self, receiving: list[asyncio.Future]) -> None:
        for task in receiving:
            task.cancel()
        self._members = None  # a broadcast that failed half way leaves the group unusable

    async def _start_receiving(self, urls: list[str]) -> list[asyncio.Future]:
        """`restore`'s receiving: the servers' requests, then their liveness check (last), each
        aborting the group when it fails."""
        watch = asyncio.ensure_future(self._liveness(urls))
        self._abort_when_failed(watch)
        return [*self._receive(urls), watch]

    @staticmethod
    async def _finish_receiving(receiving: list[asyncio.Future]) -> None:
        *requests, watch = receiving
        try:
            await asyncio.gather(*requests)
        finally:
            watch.cancel()

    async def _cancel(self, receiving: list[asyncio.Future]) -> None:
        self._abandon(receiving)
        await asyncio.to_thread(self._signal_abort)

    async def _reset_caches(self, urls: list[str]) -> None:
        backend, client = self.engine.backend, self.engine._client
        if not getattr(backend, "flushes_on_receive", False):
            await asyncio.gather(*(backend.reset_cache(client, url) for url in urls))

    async def _form_group(self, urls: list[str]) -> None:
        """Trainer rank 0 and every worker of the servers at `urls` join a new group, unless the
        current one is theirs already; watched as a delivery is (`_watched`)."""
        if self._members == tuple(urls):
            return
        backend, client = self.engine.backend, self.engine._client
        sizes = await asyncio.gather(*(backend.workers(client, url) for url in urls))
        rank0 = self.trainer.rank0
        host, port = (await asyncio.to_thread(self.trainer.get, [rank0.sync_address.remote()]))[0]
        name = f"weir-sync-{self.role or 'policy'}-{next(_GROUPS)}"
        world = 1 + sum(sizes)
        offsets = list(itertools.accumulate([1, *sizes]))[:-1]
        self._members, self._name, self._address = None, name, (host, port)
        join = rank0.join.remote(
            host,
            port,
            world,
            name,
            self.backend,
            backend.group_style,
            backend.per_tensor,
            self.role,
        )
        root = asyncio.ensure_future(asyncio.to_thread(self.trainer.get, [join]))
        joins = [
            asyncio.ensure_future(
                backend.init_broadcast(client, url, host, port, off, world, self.backend, name)
            )
            for url, off in zip(urls, offsets, strict=True)
        ]
        await self._watched(urls, root, joins)
        self._members = tuple(urls)
        log.info("weight sync: group %s of trainer rank 0 and %d server workers", name, world - 1)

    def _disk(self, version: int) -> int:
        """Rank 0 gathers the full weights and writes them where the servers read them."""
        assert self.disk_dir is not None
        metas = self.trainer.call("gather", self.role)[0]
        try:
            written = self.trainer.rank0.write.remote(str(self.disk_dir), version)
            path = self.trainer.get([written])[0]
        finally:
            self.trainer.get([self.trainer.rank0.release.remote()])
        if self.model_dir is not None:
            for f in self.model_dir.glob("*.json"):
                if not f.name.endswith(".index.json"):
                    shutil.copy(f, Path(path) / f.name)
        self.engine.update_weights_from_disk_sync(path, version)
        return sum(m.nbytes for m in metas)

    def _adapter_push(self, version: int) -> int:
        """Rank 0 gathers the LoRA adapter and writes it; every server loads it by name."""
        assert self.disk_dir is not None
        path = self.disk_dir / f"adapter-v{version:06d}"
        nbytes = self.trainer.call("write_adapter", str(path), self.role)[0]
        name = f"weir-{self.role or 'policy'}-v{version}"
        self.engine.update_adapter_sync(path, name, version)
        self._adapter = (str(path), name)
        return int(nbytes)

    # -- a restarted server -------------------------------------------------------------------------

    def restore(self, index: int) -> None:
        """Give server `index` (restarted, serving again) the current version, streamed from the
        shards; `WeightsNotReady` if the trainer has trained since the last push (the server waits
        for the next one). Called by the engine, which holds its update lock meanwhile."""
        if not self._pushed:
            return  # it started from the model's own weights, which are still current
        if self._adapter is not None:  # the base weights never change: load the last adapter
            url = self.engine.replicas[index].url
            path, name = self._adapter
            self.engine.run(self.engine.backend.load_adapter(self.engine._client, url, path, name))
            return
        url = self.engine.replicas[index].url
        with self.trainer._collective:  # no train call between the check and the stream
            if getattr(self.trainer, "trained", 0) != self._trained_at_push:
                raise WeightsNotReady(
                    f"the trainer moved past version {self.version}; it rejoins at the next push"
                )
            # the group and the receiving in the engine's loop; the sending in this thread,
            # which holds the trainer's (re-entrant) collective lock
            self.engine.run(self._form_group([url]))
            receiving = self.engine.run(self._start_receiving([url]))
            try:
                self._send(self.version)
                self.engine.run(self._finish_receiving(receiving))
            except BaseException:
                self.engine.run(self._cancel(receiving))
                raise
            self.engine.run(self._reset_caches([url]))
        self._members = None  # a group of that server alone: the next push forms one of all

    # -- checks --------------------------------------------------------------------------------------

    def check(self, version: int) -> float:
        """1.0 when every live server worker loaded exactly the trainer's weights (the digest its
        worker extension took of the tensors it loaded, against the same digest gathered from the
        shards); raises otherwise. With the adapter transport: every live server lists this
        version's adapter as loaded (its base weights are the model's files, never changed)."""
        if self.transport == "adapter":
            return self._check_adapter(version)
        want = self.trainer.call("weights_digest", self.dtype, self.role)[0]
        got = self.digests()
        if not got or any(d != want for d in got):
            raise RuntimeError(
                f"weight sync: {sum(d != want for d in got)} of {len(got)} server workers hold "
                f"other weights than the trainer after version {version} (cluster.verify_sync)"
            )
        return 1.0

    def _check_adapter(self, version: int) -> float:
        assert self._adapter is not None
        backend, client, name = self.engine.backend, self.engine._client, self._adapter[1]

        async def ask() -> list[list[str]]:
            urls = [r.url for i, r in enumerate(self.engine.replicas) if self.engine.healthy[i]]
            return list(await asyncio.gather(*(backend.adapters(client, url) for url in urls)))

        listed = self.engine.run(ask())
        if not listed or any(name not in names for names in listed):
            raise RuntimeError(
                f"weight sync: a server does not list adapter {name} of version {version} "
                "(cluster.verify_sync)"
            )
        return 1.0

    def digests(self) -> list[str | None]:
        """Each live server worker's digest of the weights its last update loaded (`verify`)."""
        backend, client = self.engine.backend, self.engine._client

        async def ask() -> list:
            urls = [r.url for i, r in enumerate(self.engine.replicas) if self.engine.healthy[i]]
            each = await asyncio.gather(*(backend.loaded_digest(client, url) for url in urls))
            return [d for server in each for d in server]

        return self.engine.run(ask())


def _failure(task: asyncio.Future) -> BaseException | None:
    """The exception a finished `task` raised, None if it succeeded or was cancelled."""
    return None if task.cancelled() else task.exception()
