"""The engine's decode steps replayed as CUDA graphs (engine.cuda_graphs, weir.engine.graphs): kept
on after the first-step check, the eager engine's tokens in float32, log-probs within rounding in
bfloat16, and the decode time with and without graphs (printed, and kept in GPU_CHECK_OUT)."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from weir.config.devices import set_cudnn_attention
from weir.engine import SamplingParams, TorchEngine

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _as_weir_runs():
    """cuDNN attention off, as `weir train` sets it (`model.cudnn_attention=false`): with it on,
    the eager step plans anew for every KV length (docs/gpu.md) and the timings compare that."""
    set_cudnn_attention(torch.device("cuda", 0), False)
    yield
    set_cudnn_attention(torch.device("cuda", 0), True)


def generate(model, prompts, params, graphs):
    with TorchEngine(model, eos_token_ids=[1], pad_token_id=0, cuda_graphs=graphs) as engine:
        engine.generate_many(prompts[:1], SamplingParams(max_new_tokens=2))  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.generate_many(prompts, params)
        torch.cuda.synchronize()
        return out, engine.stats(), time.perf_counter() - t0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_matches_the_eager_engine(tiny_model_dir, dtype):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).to("cuda").eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 262, (n,), generator=g).tolist() for n in (5, 17, 30, 9, 12, 3)]
    # budgets of 8..48 tokens: rows retire at different steps, so the row bucket changes
    params = [
        SamplingParams(n=4, max_new_tokens=8 * (i + 1), temperature=1.0, seed=3 + i)
        for i in range(len(prompts))
    ]
    graphs, stats, t_graphs = generate(model, prompts, params, True)
    eager, stats_eager, t_eager = generate(model, prompts, params, False)
    assert stats["decode_fixed_shape"] == 1.0, "the graph step's first-step check failed"
    assert stats["decode_graphs"] >= 2 and stats_eager["decode_graphs"] == 0
    print(f"{dtype}: decode {t_eager:.3f}s eager, {t_graphs:.3f}s graphs")
    same, errs = 0, []
    for a, b in zip(graphs, eager, strict=True):
        for x, y in zip(a, b, strict=True):
            k = next(
                (
                    i
                    for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids, strict=False))
                    if s != t
                ),
                min(len(x.token_ids), len(y.token_ids)),
            )
            same += x.token_ids == y.token_ids
            errs += (torch.tensor(x.logprobs[:k]) - torch.tensor(y.logprobs[:k])).abs().tolist()
    err = torch.tensor(errs)
    print(f"{dtype}: |graphs - eager| log-prob mean {err.mean():.2e} max {err.max():.2e}")
    if dtype == torch.float32:
        assert err.max() <= 1e-4
    else:  # one bfloat16 logit may round a whole step (0.125 at 16-32) apart
        assert err.mean() <= 2e-2 and err.max() <= 0.25
    total = sum(len(a) for a in graphs)
    if dtype == torch.float32:
        assert same == total
    else:  # bfloat16 rounding may flip a near tie and the samples part from there
        assert same >= total // 2


def test_cuda_graph_decode_time_at_workload_b_shape(tiny_model_dir):
    """64 rows x 128 tokens in bfloat16: the decode time with graphs and without, alternating."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, 262, (40,), generator=g).tolist() for _ in range(8)]
    params = SamplingParams(n=8, max_new_tokens=128, temperature=1.0, seed=5)
    times: dict[str, list[float]] = {"eager": [], "graphs": []}
    for _ in range(2):
        for mode in ("eager", "graphs"):
            _, stats, t = generate(model, prompts, params, mode == "graphs")
            times[mode].append(t)
            if mode == "graphs":
                assert stats["decode_fixed_shape"] == 1.0
    ratio = min(times["eager"]) / min(times["graphs"])
    print(f"decode 64 x 128: eager {times['eager']}, graphs {times['graphs']}, {ratio:.2f}x")
    if os.environ.get("GPU_CHECK_OUT"):
        out = Path(os.environ["GPU_CHECK_OUT"]) / "cuda_graphs.json"
        out.write_text(json.dumps({**times, "eager_over_graphs": ratio}, indent=1))


def test_graphs_are_recaptured_after_the_slabs_grow_and_the_weights_change(tiny_model_dir):
    """Reallocated slabs or new weights drop every graph and their pool; capturing again into the
    retired pool failed an allocator assert on the first H100 run of a real batch (gpu_step.py)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = model.to("cuda").eval()
    g = torch.Generator().manual_seed(2)
    small = [torch.randint(6, 262, (6,), generator=g).tolist() for _ in range(2)]
    large = [torch.randint(6, 262, (n,), generator=g).tolist() for n in range(10, 42)]
    params = SamplingParams(n=8, max_new_tokens=24, temperature=1.0, seed=9)
    new = {n: p.detach() * 1.01 for n, p in model.named_parameters()}
    outs = {}
    for graphs in (True, False):
        with TorchEngine(
            copy.deepcopy(model), eos_token_ids=[1], pad_token_id=0, cuda_graphs=graphs, seed=4
        ) as engine:
            engine.generate_many(small, SamplingParams(n=1, max_new_tokens=8))
            engine.generate_many(large, params)  # 256 rows: the slabs grow
            engine.update_weights_sync(new.items(), 1)
            outs[graphs] = engine.generate_many(large, params)
            stats = engine.stats()
        if graphs:
            assert stats["decode_fixed_shape"] == 1.0 and stats["decode_graphs"] >= 2
    assert [[c.token_ids for c in cs] for cs in outs[True]] == [
        [c.token_ids for c in cs] for cs in outs[False]
    ]
