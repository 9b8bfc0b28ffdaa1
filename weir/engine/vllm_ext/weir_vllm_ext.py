"""weir's vLLM worker extension, imported INSIDE the vLLM server's workers (its own environment).

The server is started with ``--worker-extension-cls weir_vllm_ext.WeirWorkerExtension`` and this
directory on ``PYTHONPATH``; the methods become callable on every worker through vLLM's
``collective_rpc`` (the ``/collective_rpc`` endpoint of a server in dev mode; its answer lists one
result per worker). This module imports nothing from weir: the vLLM environment does not have
weir's dependencies.

- ``weir_load_safetensors(path)``: load every ``*.safetensors`` file of a directory through vLLM's
  in-place ``reload_weights`` (HF names, as weir's trainer writes them). Runs on CPU and GPU.
- ``weir_init_broadcast`` / ``weir_receive_broadcast``: weights straight from trainer rank 0 over a
  torch.distributed group that the trainer's rank 0 and every worker of every server join (NCCL on
  GPUs, gloo on CPUs: the same code). The group is built as weir's `weir.sync.broadcast
  .BroadcastGroup` builds it (a TCPStore at rank 0, prefixed by the group's name, the backend's
  process group on it), so this worker is one more member of it. Buckets arrive one at a time and
  are loaded as they arrive (a generator feeding ``reload_weights``), so a worker holds its own
  weights and one bucket, never the whole model. A worker waits for each bucket by polling, and
  leaves the group (aborting it) when the driver sets the group's abort key in rank 0's store, as
  `weir.sync.broadcast.finish` does: a server that died half way does not leave it blocked. It
  waits for the group to form the same way (`weir.sync.broadcast.form`): a member that never
  joins does not hold it in the rendezvous either.
- ``weir_weights_hash()``: sha256 of the model's parameters, to check that an update went in;
  ``weir_loaded_digest()``: the digest of the tensors the last update loaded (HF names), to compare
  with the trainer's.
- ``weir_memory()`` / ``weir_reset_memory_peak()``: this worker process's resident memory now and at
  its peak, to measure what a sync costs it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import threading
import time
from pathlib import Path

ABORT_CHECK_S = 0.25  # as weir.sync.broadcast.ABORT_CHECK_S


class WeirWorkerExtension:
    """Mixed into vLLM's worker class; ``self.model_runner.model`` is the served model."""

    def weir_load_safetensors(self, path: str, digest: bool = False) -> int:
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {path}")

        tensors: dict = {}
        for f in files:
            tensors.update(load_file(str(f)))
        self._weir_digest = (
            combine_digests({k: tensor_digest(k, v) for k, v in tensors.items()})
            if digest
            else None
        )
        _tie_lm_head(self.model_runner.model_config.hf_config, tensors)
        # vLLM's in-place reload, not model.load_weights: after loading, vLLM repacks some weights
        # into kernel formats (on CPU the linear layers' original parameters are emptied), and
        # reload_weights re-runs that processing layer by layer.
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)

    def weir_weights_hash(self) -> str:
        h = hashlib.sha256()
        for name, p in sorted(self.model_runner.model.named_parameters()):
            t = p.detach().float().cpu().contiguous()
            h.update(f"{name}|{tuple(t.shape)}|".encode())
            h.update(t.numpy().tobytes())
        return h.hexdigest()

    def weir_worker_rank(self) -> int:
        """This worker's rank among the server's workers (tensor-parallel rank)."""
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().rank

    def weir_init_broadcast(
        self,
        host: str,
        port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "nccl",
        name: str = "weir-sync",
        timeout_s: float = 600.0,
    ) -> int:
        """Join the weight-broadcast group (rank 0: the trainer's rank 0) as rank
        ``rank_offset + this worker's rank``; returns that rank. Blocks until every member joined."""
        import datetime

        import torch
        import torch.distributed as dist

        old = getattr(self, "_weir_group", None)
        self._weir_group = None
        del old
        rank = self.weir_worker_rank() + rank_offset
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
        prefix = dist.PrefixStore(name, store)
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())

            def make():
                pg = dist.ProcessGroupNCCL(prefix, rank, world_size)
                connect = getattr(pg, "eager_connect_single_device", None)
                if connect is not None:  # the communicator now, inside _form's abortable wait
                    connect(device)
                return pg
        else:
            device = torch.device("cpu")

            def make():
                return dist.ProcessGroupGloo(prefix, rank, world_size, timeout)

        key = f"weir-abort/{name}"
        self._weir_group = (store, _form(make, host, port, key), device, key)
        return rank

    def weir_receive_broadcast(self, buckets: list, digest: bool = False) -> dict:
        """Receive `buckets` (lists of [name, dtype, shape], in the order rank 0 sends them) and load
        each tensor as its bucket arrives. Returns the tensors loaded and, with `digest`, the
        digest of what was loaded (`weir_loaded_digest`)."""
        import torch
        import torch.distributed as dist

        group = getattr(self, "_weir_group", None)
        if group is None:
            raise RuntimeError("weir_init_broadcast first")
        store, pg, device, abort_key = group
        tied = getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False)
        names = {m[0] for bucket in buckets for m in bucket}
        digests: dict[str, str] = {}
        failed: list[Exception] = []

        def stream():
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            for bucket in buckets:
                numel = [_numel(m[2]) for m in bucket]
                flat = torch.empty(sum(numel), dtype=getattr(torch, bucket[0][1]), device=device)
                work = pg.broadcast([flat], opts)
                try:
                    _finish(work, store, abort_key)
                except Exception as err:
                    self._weir_group = None  # unusable: the next sync forms a new group
                    _abandon(pg, work)
                    # end the reload rather than raise into it: vLLM finishes its layerwise
                    # reload only when the iterator ends (a raise leaves its layers on the meta
                    # device with wrapped loaders, and every later reload fails); the layers
                    # loaded so far hold new weights, the others keep theirs, until the retry
                    failed.append(err)
                    return
                if flat.is_cuda:
                    torch.cuda.current_stream().synchronize()
                # vLLM's reload holds a layer's tensors until the layer has all of them: the
                # module the bucket ends in may go on in the next bucket, so its tensors are
                # copied out, and the bucket's buffer is free once this bucket is loaded
                tail = _parent(bucket[-1][0])
                for (name, _, shape), part in zip(bucket, flat.split(numel), strict=True):
                    t = part.view(shape)
                    if _parent(name) == tail:
                        t = t.clone()
                    if digest:
                        digests[name] = tensor_digest(name, t)
                    yield name, t
                    if (
                        tied
                        and name == "model.embed_tokens.weight"
                        and "lm_head.weight" not in names
                    ):
                        yield "lm_head.weight", t  # see _tie_lm_head
                del flat, part, t

        self.reload_weights(weights_iterator=stream(), is_checkpoint_format=True)
        if failed:
            self._weir_digest = None
            raise failed[0]
        self._weir_digest = combine_digests(digests) if digest else None
        return {"tensors": len(names)}

    def weir_loaded_digest(self) -> str | None:
        return getattr(self, "_weir_digest", None)

    def weir_memory(self) -> dict:
        """Resident memory of this worker's process now and at its peak (bytes, from /proc)."""
        return _proc_memory()

    def weir_reset_memory_peak(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (VmHWM) to the current one


def _finish(work, store, key: str) -> None:
    """Wait for a collective by polling; RuntimeError if `key` appears in `store` first (the
    driver aborted the group: a member failed). As weir.sync.broadcast.finish."""
    start = time.monotonic()
    check = start + ABORT_CHECK_S
    while not work.is_completed():
        now = time.monotonic()
        if now >= check:
            if store.check([key]):
                raise RuntimeError(f"weight sync: group aborted by the driver ({key})")
            check = now + ABORT_CHECK_S
        time.sleep(0 if now - start < 0.005 else 0.0005)
    work.wait()


def _form(make, host: str, port: int, key: str):
    """Build a process group by ``make()`` in a daemon thread and wait for it; RuntimeError if
    `key` appears first in rank 0's store (a member never joined), asked through a connection of
    its own (the rendezvous holds the group's). As weir.sync.broadcast.form."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(  # 30 s: weir.sync.broadcast.ABORT_GRACE_S
        host, port, is_master=False, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )
    done: dict = {}

    def build() -> None:
        try:
            done["group"] = make()
        except BaseException as err:
            done["error"] = err

    thread = threading.Thread(target=build, name=f"weir-form-{key}", daemon=True)
    thread.start()
    while True:
        thread.join(ABORT_CHECK_S)
        if not thread.is_alive():
            break
        if store.check([key]):
            raise RuntimeError(f"weight sync: group aborted by the driver while it formed ({key})")
    if "error" in done:
        raise done["error"]
    return done["group"]


def _abandon(pg, work) -> None:
    """Leave the group after a failure, as weir.sync.broadcast.abandon: abort it where the
    backend can; a collective still pending pins it for the life of the process (destroying it
    would wait for that collective's timeout)."""
    with contextlib.suppress(AttributeError, RuntimeError):
        pg.abort()
    if not work.is_completed():
        for obj in (pg, work):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _parent(name: str) -> str:
    """The module a weight belongs to, one level up (q_proj, k_proj, v_proj -> self_attn): the
    tensors vLLM may fuse into one layer share it."""
    return name.rsplit(".", 2)[0]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def tensor_digest(name: str, t) -> str:
    """sha256 of one tensor's name, dtype, shape and bytes (weir.sync.hashing.tensor_digest)."""
    c = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{name}|{c.dtype}|{tuple(c.shape)}|".encode())
    if c.numel():
        h.update(c.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def combine_digests(digests: dict) -> str:
    """One digest of many tensors' digests, in name order (weir.sync.hashing.combine_digests)."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}:{digests[name]};".encode())
    return h.hexdigest()


def _proc_memory() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) * 1024
    return out


def _tie_lm_head(hf_config, tensors: dict) -> None:
    """Give a tied model's lm_head its weights explicitly.

    A trainer's ``named_parameters()`` lists a tied embedding once (``model.embed_tokens.weight``).
    vLLM 0.32's in-place reload does not keep the tie once ``lm_head.weight`` has been loaded on
    its own (measured: after one update that carried it, later updates without it left lm_head on
    the old weights), so weir always sends both.
    """
    if (
        getattr(hf_config, "tie_word_embeddings", False)
        and "lm_head.weight" not in tensors
        and "model.embed_tokens.weight" in tensors
    ):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
