"""`TorchEngine`: weir's built-in inference engine, running on the Hugging Face model object it is given.

It is the same module class the trainer uses (in a colocated loop, literally the trainer's module), so
its log-probs are computed by the trainer's own kernels.

How it works
------------
A daemon thread runs the decode loop over one *running batch*. Each iteration:

1. admits waiting requests (up to ``max_batch_size`` rows): their prompts are prefilled together in one
   left-padded forward pass, each prompt ONCE; the first token of every sample is drawn from the
   prompt's logits, and the prompt's KV cache is copied into one row per surviving sample (shared
   prefix) of the running batch;
2. runs one decode step for every row: the model's own ``forward`` over the last token of each row,
   with the KV cache (`weir.hf_compat.cache_kwargs`), an explicit 4D attention mask, explicit position ids and
   ``logits_to_keep=1`` (for Llama-family models the same operations without the HF module
   machinery, checked bit for bit against the model's forward: `weir.engine.decode`);
3. samples the next token of every row with tensor ops (no per-row Python), and retires the rows that
   emitted a stop token or reached their length limit: their futures are resolved at once and the rows
   leave the batch.

The KV cache is a `transformers.cache_utils.Cache` whose layers are preallocated slabs
``[row_capacity, kv_heads, col_capacity, head_dim]``; the rows ``[0, n)`` and the columns
``[c0, c0 + length)`` are in use. All rows are right-aligned: each row's last token sits in the last
used column, the left columns of shorter rows are padding, masked out. So a decode step writes one
column for all rows in place (no re-concatenation); a finished row's slot is filled by moving the last
row into it (only the moved rows are copied); the columns that became padding for every remaining row
are dropped by advancing ``c0``; newcomers are written into free rows, extending the used columns to
the left when their prompt is longer. When rows or columns run out the slabs are reallocated with
doubled capacity (within the KV budget), so that most admissions reuse them; when only the right
edge ran out, the live columns move within the slabs. Memory is accounted exactly and admission
respects ``kv_budget_gb`` (`weir.engine.kv_budget`); ``sleep_sync`` / ``wake_sync`` free the KV
cache (and optionally park the weights in host memory) while a colocated trainer trains.

Sampling and seeds
------------------
Each sample owns a counter-based random stream (a 32-bit key derived from the request's seed and the
sample index; the uniform for its t-th token is ``mix32(key + t * golden)``). A token is drawn by
inverting the CDF of ``softmax(logits / T)`` at that uniform. The draw depends only on the row's own
logits, key and token index, so a seeded request gives the same samples however it is batched.
Top-k / top-p rows sample from their sorted, filtered distribution (as HF and vLLM do: top-k first,
then top-p on the renormalised top-k mass). Reported log-probs follow `weir.engine.base`:
``log_softmax(logits / T)[token]`` over the full vocabulary (T = 1 for greedy), whatever the filters.

Weights and versions
--------------------
``update_weights`` takes the step lock, so it runs between decode steps; it copies tensors into the
model's parameters in place (no copy when a tensor *is* the parameter, as in a colocated loop, where it
only sets the version) and sets ``version``. Every generated token records the version current when
it was produced, so a response in flight across an update carries both versions. Before decoding on,
the KV cache of the requests in flight is recomputed under the new weights (one batched prefill of
their prompt + tokens so far), so every token after the update is sampled from the new policy on the
full context and its log-prob is exactly the new policy's (``recompute_kv_on_update=False`` skips this).

Thread-safety: ``submit`` / ``generate`` may be called from any thread or event loop. The control
methods (``pause`` / ``resume`` / ``drain`` / ``abort`` / ``update_weights``) have async forms for the
`Engine` protocol and ``*_sync`` forms for plain threads; they must not be called from the engine
thread itself (a concurrent future's done-callback), except ``close``.

Modules
-------
This module holds the engine's thread and its loop; control between steps (weight updates, pause,
drain, abort) is in `weir.engine.control`. The decode step, and the direct forward it runs
for Llama-family models, are in `weir.engine.decode`; admission (prefill, retirement) is in
`weir.engine.admission`, which waiting requests join in `weir.engine.scheduler`, sampling in
`weir.engine.sampler`, the running batch and its KV slabs in
`weir.engine.slabs`, requests and their futures in `weir.engine.requests`, the random streams in
`weir.engine.streams`, the KV budget in `weir.engine.kv_budget`, sleep/wake and memory stats in
`weir.engine.memory`,
and per-layer-type attention masks in `weir.engine.masks`.
"""

from __future__ import annotations

import asyncio
import atexit
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from transformers import PreTrainedModel

from weir.data.moe_routing import install_routing
from weir.data.vision import VisionInputs
from weir.data.vision_model import vision_model
from weir.engine.admission import Admission
from weir.engine.base import Completion, SamplingParams, SyncControl, params_per_prompt
from weir.engine.control import Control
from weir.engine.decode import DecodeForward, Decoding
from weir.engine.graphs import static_decode
from weir.engine.kv_budget import (
    KVMeter,
    KVState,
    bind_meter,
    measure_cell_bytes,
    resolve_budget,
)
from weir.engine.memory import EngineMemory, OffloadedWeights
from weir.engine.prefix_cache import PrefixCache
from weir.engine.requests import Request, set_exception
from weir.engine.scheduler import Scheduling
from weir.engine.slabs import RunningBatch
from weir.engine.support import model_support
from weir.telemetry.timeline import span

__all__ = ["TorchEngine"]

# ---------------------------------------------------------------------------------------------------


_LIVE_ENGINES: weakref.WeakSet[TorchEngine] = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    # Stop the loop threads before the interpreter tears down (a daemon thread frozen inside a
    # torch kernel at exit can abort the process).
    for engine in list(_LIVE_ENGINES):
        engine.close(timeout=2.0)


class TorchEngine(Admission, Decoding, Scheduling, EngineMemory, Control, SyncControl):
    """Continuous-batching sampler over a Hugging Face causal LM (see the module docstring).

    Args:
        model: a decoder-only HF model of an architecture in `weir.engine.support.SUPPORTED`
            (others raise `UnsupportedModel`) using the ``sdpa`` or ``eager`` attention
            implementation; sliding windows and hybrid sliding/full layers are masked exactly.
            It is used as given: keep it in eval mode (or dropout-free) and do not run it
            concurrently from another thread while generating.
        eos_token_ids: tokens that always end a sample.
        pad_token_id: id fed at padding positions (masked out; any valid id works).
        max_batch_size: most rows (samples) decoding at once. A single request with ``n`` above it
            is still admitted when the batch is empty.
        max_seq_len: prompt + response limit; defaults to ``config.max_position_embeddings``.
            Reaching it ends a sample with finish_reason "length".
        seed: seeds the per-request streams of requests that do not set ``SamplingParams.seed``
            (assigned in submission order).
        version: the initial weight version.
        max_prefill_tokens: budget of (padded) prompt tokens prefilled in one forward pass.
        recompute_kv_on_update: after ``update_weights``, rebuild the KV cache of the requests in
            flight under the new weights (one prefill of their prompt + tokens so far) before
            decoding on, so that every token after the update is sampled from, and its log-prob
            computed by, the new policy on the full context. False keeps the old-weight KV of the
            earlier tokens (cheaper, but then those later log-probs match neither policy exactly).
        num_threads: torch intra-op threads of the engine thread only (OpenMP's setting is per
            thread; the rest of the process keeps its own). None inherits torch's default. With a
            trainer in another thread on the same machine, or a tiny model, 1 is often fastest.
        kv_budget_gb: the most KV cache (GiB, the engine's own slab arithmetic, see
            `weir.engine.kv_budget`) alive at once, prefill and scratch included. Requests that do
            not fit wait (first come, first served); one that can never fit fails with
            `KVBudgetError`. Activations are not counted.
        kv_budget_fraction: instead, that fraction of the device memory free when the engine starts.
        kv_idle_release_s: give the KV slabs back after this many idle seconds (None: keep them).
        prefix_cache: keep the KV of finished ``keep_kv`` requests (multi-turn episodes) and reuse
            it for the request that continues the conversation (`weir.engine.prefix_cache`; with
            images too: `weir.engine.vision_prefix`).
        prefix_cache_entries: most entries kept (default: ``max_batch_size``).
        share_prefixes: compute once a prefix that the prompts admitted together, or the rows of a
            KV rebuild, share (a prompt's episodes, a system message), when that saves enough
            (`weir.engine.shared_prefix`). False: every sequence is prefilled whole (the numbers
            then differ only by rounding).
        direct_decode: run decode steps through `weir.engine.decode.DecodeForward` (the same
            operations as the HF forward without its module machinery; Llama-family models only,
            checked bit for bit against the HF forward on the first decode step). False: always
            the HF forward.
        cuda_graphs: on CUDA, replay decode steps of the direct forward as CUDA graphs
            (`weir.engine.graphs`; checked against the eager step on first use). ``"eager"`` runs
            the same fixed-shape step without capture, on any device (tests, debugging).
        record_routing: record the experts each MoE layer's router picks for every token (prompt
            and generated), returned as `Completion.routed_experts` for the trainer to replay
            (`weir.data.moe_routing`; `algo.routing_replay`). A model without a router weir knows
            raises `UnsupportedRouting`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        max_batch_size: int = 256,
        max_seq_len: int | None = None,
        seed: int = 0,
        version: int = 0,
        max_prefill_tokens: int = 16384,
        recompute_kv_on_update: bool = True,
        num_threads: int | None = None,
        kv_budget_gb: float | None = None,
        kv_budget_fraction: float | None = None,
        kv_idle_release_s: float | None = None,
        prefix_cache: bool = True,
        prefix_cache_entries: int | None = None,
        share_prefixes: bool = True,
        direct_decode: bool = True,
        cuda_graphs: bool | str = True,
        record_routing: bool = False,
    ):
        config = model.config
        attn = getattr(config, "_attn_implementation", None) or "eager"
        self._support = model_support(config)  # raises UnsupportedModel (see weir.engine.support)
        self._vision = vision_model(model)  # pixels and M-RoPE positions (None: text-only model)
        # A sampled image placeholder has no pixels behind it: the sample stops there (and the
        # rollout fails it), so no forward ever sees more placeholders than image features.
        self._placeholders = (
            [self._vision.image_token_id, self._vision.video_token_id] if self._vision else []
        )
        config = config.get_text_config()
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.version = version
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = max_batch_size
        self.max_seq_len = int(max_seq_len or getattr(config, "max_position_embeddings", 2048))
        self.max_prefill_tokens = max_prefill_tokens
        self._recompute_kv_on_update = recompute_kv_on_update
        self._share_prefixes = share_prefixes
        self._num_threads = num_threads
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._num_layers = int(config.num_hidden_layers)
        self._eager = attn == "eager"
        first = next(model.parameters())
        self._device, self._dtype = first.device, first.dtype
        self._col = torch.arange(self.max_seq_len + 1, device=self._device)
        self._vocab_col = torch.arange(self.vocab_size, device=self._device)
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._params.update(dict(model.named_buffers(remove_duplicate=False)))
        self._kv = KVState(
            cell=measure_cell_bytes(model, self.pad_token_id),
            tensors=2 * self._num_layers,
            budget=resolve_budget(kv_budget_gb, kv_budget_fraction, self._device),
            max_cols=self.max_seq_len,
            meter=KVMeter(),
        )
        self._kv_idle_release_s = kv_idle_release_s
        self._prefix = (
            PrefixCache(self._kv.meter, prefix_cache_entries or max_batch_size)
            if prefix_cache
            else None
        )
        # routing recorded: every forward through the model's own (hooked) modules
        self._routing = install_routing(model) if record_routing else None
        self._last_routes: torch.Tensor | None = None
        self._direct = (
            DecodeForward.build(model, self._support.per_layer_type, self._vision is not None)
            if direct_decode and self._routing is None
            else None
        )
        self._direct_checked = False
        self._static = static_decode(
            self._direct, model, self._support, self._dtype if self._eager else None, cuda_graphs
        )
        self._static_checked = False
        self._last_busy = time.monotonic()
        self._asleep = False
        self._offloaded: OffloadedWeights | None = None
        self._arriving: OffloadedWeights | None = None  # a lazy wake's values still on the host

        self._rng = random.Random(seed)
        self._mu = threading.Lock()  # guards the pending queue and the flags below
        self._cond = threading.Condition(self._mu)
        self._step_lock = threading.Lock()  # held for one loop iteration, or by a control operation
        self._pending: deque[Request] = deque()
        self._cancelled: set[Request] = set()
        self._paused = False
        self._holding = False  # drain_sync: admit nothing new until resume_sync
        self._interrupts = 0
        self._closed = False
        self._stopping = False
        self._stale_kv = False  # set by a weight update: rebuild the running rows' KV cache
        self._batch = self._new_batch()
        self._stats = {
            "requests": 0,
            "generated_tokens": 0,
            "prefill_tokens": 0,
            "recomputed_tokens": 0,
            "shared_prefix_tokens": 0,
            "admitted": 0,
            "decode_steps": 0,
            "busy_s": 0.0,
            "wake_restored_bytes": 0,  # offloaded weights copied back (not written by an update)
            # a new thread starts on the creating thread's count, so this is what decodes
            "threads": float(num_threads or torch.get_num_threads()),
        }
        self._thread = threading.Thread(target=self._run, name="weir-torch-engine", daemon=True)
        self._thread.start()
        _LIVE_ENGINES.add(self)

    # -- plain-thread API --------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        vision: VisionInputs | None = None,
    ) -> Future[list[Completion]]:
        """Queue one prompt; the future resolves to its ``params.n`` completions (or the error).
        `vision`: the prompt's pixel inputs (a vision-language model's prompt with images)."""
        return self.submit_many([prompt_ids], params, [vision])[0]

    def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        visions: Sequence[VisionInputs | None] | None = None,
    ) -> list[Future[list[Completion]]]:
        """Queue several prompts at once (they are admitted together); one future per prompt.

        `params` is one `SamplingParams` for all prompts or one per prompt. (With one seeded params
        object for all prompts, every prompt uses the same random streams.) `visions`: each
        prompt's pixel inputs or None.
        """
        params = params_per_prompt(params, len(prompts))
        visions = list(visions) if visions is not None else [None] * len(prompts)
        futures: list[Future[list[Completion]]] = []
        reqs: list[Request] = []
        with self._mu:
            if self._closed:
                raise RuntimeError("TorchEngine is closed")
            for prompt_ids, sp, vision in zip(prompts, params, visions, strict=True):
                fut: Future[list[Completion]] = Future()
                futures.append(fut)
                prompt = [int(x) for x in prompt_ids]
                error = self._check_prompt(prompt) or self._check_vision(prompt, vision)
                if error is not None:
                    fut.set_exception(error)
                    continue
                seed = sp.seed if sp.seed is not None else self._rng.getrandbits(64)
                self._stats["requests"] += 1
                if sp.max_new_tokens == 0:
                    fut.set_result([Completion([], [], [], "length") for _ in range(sp.n)])
                    continue
                req = Request(prompt, sp, fut, seed, vision)
                reqs.append(req)
                self._pending.append(req)
            self._cond.notify_all()
        for req in reqs:
            req.future.add_done_callback(lambda f, r=req: self._on_future_done(f, r))
        return futures

    def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[list[Completion]]:
        """Submit every prompt, wait for all; one list of completions per prompt, in order.

        `params` as in `submit_many`. The first failed request's exception is raised.
        """
        return [f.result() for f in self.submit_many(prompts, params)]

    def close(self, timeout: float | None = 10.0) -> None:
        """Abort what is in flight and stop the loop thread. Idempotent; callable from a completion
        callback (then the loop stops after its current iteration)."""
        with self._mu:
            self._closed = True
            self._stopping = True  # the loop aborts what is left when it exits
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    stop = close

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine computes in (its model's)."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue sampling exactly: the seed stream of unseeded requests
        and the weight version. Take it when no request is in flight."""
        with self._mu:
            return {"rng": self._rng.getstate(), "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._mu:
            self._rng.setstate(state["rng"])
        self._set_version(state["version"])

    def stats(self) -> dict[str, float]:
        """Counters since start: requests, generated/prefill tokens (``recomputed_tokens``: those
        prefilled again to rebuild KV after a weight update; ``shared_prefix_tokens``: those not
        prefilled because a prefix shared by the sequences of one prefill was computed once),
        decode steps, busy seconds; ``threads``, the torch threads the engine thread computes on;
        ``decode_direct`` is 1 while decode steps run through `weir.engine.decode.DecodeForward`;
        ``decode_fixed_shape`` 1 while they run as fixed-shape steps (`weir.engine.graphs`),
        ``decode_graphs`` the CUDA graphs captured for them."""
        with self._mu:
            out = dict(self._stats)
            out["running_rows"] = self._batch.n
            out["waiting_requests"] = len(self._pending)
            out["decode_direct"] = float(self._direct is not None)
            out["decode_graphs"] = float(self._static.captured if self._static else 0)
            out["decode_fixed_shape"] = float(self._static is not None)
        out.update(self.kv_stats())
        out.update(self.prefix_stats())
        return out

    # -- async API (the Engine protocol) -----------------------------------------------------------

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        vision: VisionInputs | None = None,
    ) -> list[Completion]:
        return await asyncio.wrap_future(self.submit(prompt_ids, params, vision))

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        await asyncio.to_thread(self.update_weights_sync, named_tensors, version)

    # -- internals: control ------------------------------------------------------------------------

    def _check_prompt(self, prompt: list[int]) -> Exception | None:
        if not prompt:
            return ValueError("prompt_ids is empty; the engine needs at least one prompt token")
        if len(prompt) >= self.max_seq_len:
            return ValueError(
                f"prompt has {len(prompt)} tokens; the engine's max_seq_len is {self.max_seq_len}"
            )
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            return ValueError(
                f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        return None

    def _check_vision(self, prompt: list[int], vision: VisionInputs | None) -> Exception | None:
        if self._vision is None:
            if vision is not None:
                return ValueError(
                    "the request has images but the engine's model is text-only; use a "
                    "vision-language model (docs/multimodal.md)"
                )
            return None
        try:
            self._vision.check(prompt, vision)
        except ValueError as err:
            return err
        return None

    def _on_future_done(self, fut: Future, req: Request) -> None:
        if fut.cancelled():
            with self._mu:
                self._cancelled.add(req)

    def _new_batch(self) -> RunningBatch:
        return RunningBatch(self._num_layers, self._device, self.max_batch_size, self._kv)

    # -- internals: the loop -----------------------------------------------------------------------

    def _run(self) -> None:
        died: BaseException | None = None
        try:
            self._loop()
        except BaseException as exc:  # not an Exception (those are handled per iteration)
            died = exc
            raise
        finally:
            with self._mu:
                self._closed = self._stopping = True
            with self._step_lock, torch.inference_mode(False):
                if self._offloaded is not None:  # closed asleep: the model gets its weights back
                    self._offloaded.restore()
                    self._offloaded = None
                self._weights_in_place()
                if died is None:
                    self._abort_all()
                else:  # never leave a caller waiting
                    self._fail_all(RuntimeError(f"the TorchEngine thread died: {died!r}"))

    def _loop(self) -> None:
        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        bind_meter(self._kv.meter)
        while True:
            with self._mu:
                while not self._stopping and (
                    self._paused
                    or self._asleep
                    or self._interrupts
                    or (not self._batch.n and (self._holding or not self._pending))
                ):
                    self._idle_wait()
                if self._stopping:
                    break
            with self._step_lock:
                with self._mu:  # re-check: a pause or a control operation may have come between
                    if self._paused or self._interrupts or self._stopping:
                        continue
                t0 = time.perf_counter()
                try:
                    with torch.inference_mode(), span("decode", cat="engine", merge_gap_ms=2):
                        self._iteration()
                except Exception as exc:  # never let the loop die: fail what is in flight
                    self._fail_running(exc)
                self._stats["busy_s"] += time.perf_counter() - t0
                if self._holding and not self._batch.n:
                    with self._mu:
                        self._cond.notify_all()  # a drain_sync waits for this
                self._last_busy = time.monotonic()

    def _idle_wait(self) -> None:
        """Wait for work (`_mu` held); when idle for ``kv_idle_release_s``, give the slabs back."""
        b, delay = self._batch, self._kv_idle_release_s
        if delay is None or b.n or b.cache is None or self._pending:
            self._cond.wait()
            return
        left = self._last_busy + delay - time.monotonic()
        if left > 0:
            self._cond.wait(left)
        elif self._step_lock.acquire(blocking=False):  # not while a control operation runs
            try:
                self._release_memory()
            finally:
                self._step_lock.release()
        else:
            self._cond.wait()

    def _iteration(self) -> None:
        self._weights_in_place()  # after a lazy wake that no update followed (yet)
        if self._cancelled:
            self._drop_cancelled()
        if self._stale_kv:
            self._stale_kv = False
            if self._batch.n:
                self._batch.cache = None  # rebuilt from the tokens: free the old KV first
                self._recompute_kv()
        newcomers = [] if self._holding else self._take_pending()
        if newcomers:
            self._admit(newcomers)
        if self._batch.n:
            self._decode_step()

    def _fail_all(self, exc: BaseException) -> None:
        with self._mu:
            pending = list(self._pending)
            self._pending.clear()
        for req in pending:
            set_exception(req.future, exc)
        self._fail_running(exc)

    def _fail_running(self, exc: BaseException) -> None:
        b = self._batch
        self._batch = self._new_batch()
        for req in set(b.reqs):
            set_exception(req.future, exc)
