"""Timing pieces of benchmarks/gpu_trainer.py: a step timed with CUDA events, one step under
torch.profiler, the LM-head statistics alone (each kernel against the reference functions), and
the Triton head kernels' block sizes."""

from __future__ import annotations

import functools
import gc
import time
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(actor, batch, device: torch.device) -> tuple[float, float, dict[str, float]]:
    """One `actor.train(batch)`: (seconds between CUDA events around it, host seconds, stats)."""
    sync(device)
    t0 = time.perf_counter()
    if device.type != "cuda":
        stats = actor.train(batch)
        wall = time.perf_counter() - t0
        return wall, wall, stats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    stats = actor.train(batch)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, time.perf_counter() - t0, stats


def phase_split(actor, batch, device: torch.device) -> dict[str, float]:
    """One `actor.train(batch)` with the device synchronised around its phases: the micro-batches'
    forwards and backwards (`_accumulate`), the rest of each update (`_update` less those: the
    counts' read, gradient clipping, AdamW, the metrics' read), and the rest of the step (the
    batch's copy to the device, the layout's choice, advantages). The synchronisations add waits
    the timed steps do not have: it says where the time goes, not how long a step takes."""
    spent = {"forward_backward_s": 0.0, "update_s": 0.0}

    def timing(method, key: str):
        def run(*args, **kwargs):
            sync(device)
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                sync(device)
                spent[key] += time.perf_counter() - t0

        return run

    actor._accumulate = timing(actor._accumulate, "forward_backward_s")
    actor._update = timing(actor._update, "update_s")
    try:
        sync(device)
        t0 = time.perf_counter()
        actor.train(batch)
        sync(device)
        total = time.perf_counter() - t0
    finally:  # the instance attributes go: the class's methods again
        del actor._accumulate, actor._update
    fb = spent["forward_backward_s"]
    return {
        "total_s": total,
        "forward_backward_s": fb,
        "update_rest_s": spent["update_s"] - fb,
        "outside_updates_s": total - spent["update_s"],
    }


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profile_step(actor, batch, device: torch.device, top: int) -> dict[str, Any]:
    """One warm step under torch.profiler: the `top` kernels (CPU ops on a CPU) by self time,
    their counts and share of all kernel time, and kernel time against the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        actor.train(batch)
        sync(device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()

    def self_us(e) -> float:
        if not cuda:
            return float(e.self_cpu_time_total)
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)))

    rows = [e for e in events if self_us(e) > 0 and (not cuda or _on_device(e))]
    total = sum(self_us(e) for e in rows)
    rows.sort(key=self_us, reverse=True)
    return {
        "wall_s": wall,
        "kernel_s": total / 1e6,
        "busy": total / 1e6 / wall if wall else None,
        "top": [
            {
                "name": e.key[:120],
                "calls": e.count,
                "ms": self_us(e) / 1e3,
                "share": self_us(e) / total,
            }
            for e in rows[:top]
        ],
    }


def _on_device(event) -> bool:
    kind = getattr(event, "device_type", None)
    return kind is not None and "CUDA" in str(kind)


def head_bench(vocab: int, rows: int, device: torch.device, repeat: int) -> dict[str, Any]:
    """Log-probs + entropy, forward and backward, on `rows` x `vocab` bf16 logits: the reference
    functions and each fused kernel there is; time, peak memory and largest differences from the
    reference (entropy without gradient, as with `algo.entropy_coef=0`). `peak_gb`: the peak of one
    run above what was allocated before it."""
    from weir.algo import entropy as E

    g = torch.Generator(device=device).manual_seed(0)
    base = (torch.randn(rows, vocab, generator=g, device=device) * 3).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (rows,), generator=g, device=device)
    weight = torch.randn(rows, generator=g, device=device)
    kernels = ["reference"]
    if hasattr(E, "token_logprobs_and_entropy"):
        kernels += ["eager"] + (["compiled"] if E.compile_status(device) == "available" else [])
    triton = getattr(E, "logprob_triton", None)  # absent before the Triton kernels
    if triton is not None and triton.triton_status(device) == "available":
        kernels.append("triton")

    def run(kernel: str):
        logits = base.clone().requires_grad_(True)
        if kernel == "reference":
            lp = E.logprobs_from_logits(logits, ids, 256, allow_nonfinite=True)
            h = E.entropy_from_logits(logits.detach(), 256, allow_nonfinite=True)
        else:
            lp, h = E.token_logprobs_and_entropy(logits, ids, 256, entropy="value", kernel=kernel)
        (lp * weight).sum().backward()
        return lp.detach(), h.detach(), logits.grad

    out: dict[str, Any] = {"rows": rows, "vocab": vocab}
    ref = None
    for kernel in kernels:
        try:
            t0 = time.perf_counter()
            first = run(kernel)
            sync(device)
            cold = time.perf_counter() - t0
            held = 0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                held = torch.cuda.memory_allocated(device)  # `first` and the reference's outputs
            times = []
            for _ in range(repeat):
                sync(device)
                t0 = time.perf_counter()
                run(kernel)
                sync(device)
                times.append(time.perf_counter() - t0)
            row: dict[str, Any] = {"first_s": cold, "s": sorted(times)}
            if device.type == "cuda":
                # what the kernel's own run adds: the outputs kept from earlier runs (the
                # reference's, 2 bytes x rows x vocab of gradient) are not its cost
                row["peak_gb"] = (torch.cuda.max_memory_allocated(device) - held) / 2**30
            if ref is None:
                ref = first
            else:
                row["max_diff"] = {
                    k: float((a.float() - b.float()).abs().max())
                    for k, a, b in zip(("logp", "entropy", "grad"), first, ref, strict=True)
                }
            out[kernel] = row
        except Exception as err:  # noqa: BLE001 - one kernel failing must not stop the others
            out[kernel] = {"error": f"{type(err).__name__}: {err}"[:300]}
        free(device)
    if "triton" in kernels:  # a failure falls back to the chunks: its "triton" row timed them
        out["triton_failure"] = list(E._triton_failure)
        out["triton_blocks"] = triton_block_sweep(base, ids, device, repeat)
    return out


FWD_CONFIGS = ((2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16))
"""(columns per step, warps) of the Triton forward that `triton_block_sweep` times."""
BWD_CONFIGS = ((1024, 2), (2048, 4), (4096, 4), (4096, 8), (8192, 16))
"""(columns per program, warps) of the Triton backward that `triton_block_sweep` times."""


def triton_block_sweep(
    logits: torch.Tensor, ids: torch.Tensor, device: torch.device, repeat: int
) -> dict[str, Any]:
    """The Triton forward (with the entropy) and backward (log-prob term) alone at each
    (block, warps) of `FWD_CONFIGS` / `BWD_CONFIGS` (weir's defaults: logprob_triton.FWD_BLOCK_V
    and BWD_BLOCK_V, `_warps(block)` warps): the best of `repeat` runs after one that compiles, in
    ms (CUDA events on a GPU), and the bytes each moves over that time (forward: the logits read
    once; backward: read once, the gradient written once), in GB/s, to set against the GPU's
    memory bandwidth. Meaningful at thousands of rows (one program a row in the forward: a few
    hundred rows leave SMs idle)."""
    from weir.algo import logprob_triton as lt

    n, v = logits.shape
    elem = logits.element_size()

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeat):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return min(times)

    m, log_s, _, h = lt.stats(logits, ids, 1.0, True)
    g = torch.ones(n, device=device)

    def forward(block: int, warps: int) -> Any:
        return lt.stats(logits, ids, 1.0, True, block, warps)

    def backward(block: int, warps: int) -> Any:
        return lt.grad(logits, ids, m, log_s, h, g, None, 1.0, block, warps)

    out: dict[str, Any] = {
        "rows": n,
        "defaults": [
            [lt.FWD_BLOCK_V, lt._warps(lt.FWD_BLOCK_V)],
            [lt.BWD_BLOCK_V, lt._warps(lt.BWD_BLOCK_V)],
        ],
    }
    for name, configs, moved, run in (
        ("forward", FWD_CONFIGS, n * v * elem, forward),
        ("backward", BWD_CONFIGS, 2 * n * v * elem, backward),
    ):
        rows = {}
        for block, warps in configs:
            try:
                s = best(functools.partial(run, block, warps))
                rows[f"{block}x{warps}"] = {"ms": s * 1e3, "gb_s": moved / s / 1e9}
            except Exception as err:  # noqa: BLE001 - a block that fails must not stop the others
                rows[f"{block}x{warps}"] = {"error": f"{type(err).__name__}: {err}"[:300]}
        out[name] = rows
    return out
