"""The built-in engine in a child process on CUDA (`engine.process=true`): the model and every weight
update reach the child by CUDA IPC handle, the child owns its weights once started, it runs under
the parent's CUDA backend settings (TF32, cuDNN attention), and a sync run on CUDA gives the same
first-step samples with the engine in a thread and in a process."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import weir
from tests.engine.engine_helpers import assert_parity
from tests.loop.test_engine_process import odd_tokens
from weir.config.devices import apply_backend_flags, backend_flags
from weir.engine import SamplingParams, TorchEngine
from weir.engine.process_engine import ProcessEngine

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
PARAMS = SamplingParams(n=3, temperature=1.0, max_new_tokens=16)


def _model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(CUDA).eval()


def _prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 262, (int(n),), generator=g).tolist() for n in range(4, 4 + count)]


@pytest.fixture(autouse=True)
def _exact_float32():
    """TF32 off in this process, so that float32 on both sides is exact float32."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def test_same_samples_as_the_engine_in_this_process(tiny_model_dir):
    model = _model(tiny_model_dir)
    prompts = _prompts(5, seed=1)
    with TorchEngine(copy.deepcopy(model), eos_token_ids=[1], pad_token_id=0, seed=7) as local:
        want = local.generate_many(prompts, PARAMS)
    with ProcessEngine(copy.deepcopy(model), eos_token_ids=[1], pad_token_id=0, seed=7) as eng:
        assert eng.device == CUDA
        got = eng.generate_many(prompts, PARAMS)
    assert [[c.token_ids for c in cs] for cs in got] == [[c.token_ids for c in cs] for cs in want]
    err = max(
        abs(a - b)
        for gs, ws in zip(got, want, strict=True)
        for g, w in zip(gs, ws, strict=True)
        for a, b in zip(g.logprobs, w.logprobs, strict=True)
    )
    assert err <= 1e-5


def test_weight_updates_by_cuda_ipc_and_the_child_owns_its_weights(tiny_model_dir):
    model = _model(tiny_model_dir)
    handed = copy.deepcopy(model)
    prompts = _prompts(3, seed=2)
    with ProcessEngine(handed, eos_token_ids=[1], pad_token_id=0, seed=3) as eng:
        with torch.no_grad():  # the child copied what it was handed: zeroing it changes nothing
            for p in handed.parameters():
                p.zero_()
        for prompt, cs in zip(prompts, eng.generate_many(prompts, PARAMS), strict=True):
            for c in cs:
                assert_parity(model, prompt, c, tol=1e-4)
        for version in (1, 2):  # the second update reuses the CUDA buffers of the first
            g = torch.Generator(device=CUDA).manual_seed(version)
            new = {
                n: p.detach() + 0.05 * torch.randn(p.shape, generator=g, device=CUDA)
                for n, p in model.named_parameters()
            }
            asyncio.run(eng.update_weights(new.items(), version))
            reference = copy.deepcopy(model)
            reference.load_state_dict(new, strict=False)
            for prompt, cs in zip(prompts, eng.generate_many(prompts, PARAMS), strict=True):
                for c in cs:
                    assert set(c.versions) == {version}
                    assert_parity(reference, prompt, c, tol=1e-4)
            del new  # the parent's tensors may go: the buffers are the proxy's
        assert all(b.device == CUDA for b in eng._buffers.values())


def test_the_child_runs_under_this_process_cuda_backend_settings(tiny_model_dir):
    saved = backend_flags()
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cuda.enable_cudnn_sdp(False)
        with ProcessEngine(
            _model(tiny_model_dir), eos_token_ids=[1], pad_token_id=0, seed=0
        ) as eng:
            assert eng.backends == backend_flags()
            assert eng.backends["cuda_matmul_allow_tf32"] is True
            assert eng.backends["cudnn_sdp"] is False
    finally:
        apply_backend_flags(saved)


def test_a_sync_run_on_cuda_with_the_engine_in_a_process(tmp_path):
    base = {
        "run": {"steps": 2, "eval_every": 0, "save_model": False, "seed": 5},
        "model": {"path": "tiny:nano"},
        "data": {"task": "arithmetic", "eval_size": 4},
        "rollout": {"n": 4, "batch_prompts": 4, "max_new_tokens": 12},
        "telemetry": {"console": False},
    }
    runs = {
        where: weir.run(
            {**base, "engine": {"process": where == "process"}}, [f"run.dir={tmp_path / where}"]
        ).history
        for where in ("thread", "process")
    }
    thread, process = ([h for h in runs[w] if "reward/mean" in h] for w in ("thread", "process"))
    assert len(thread) == len(process) == 2
    # the first step's samples come from the same weights and the same seeds on both sides
    for key in ("reward/mean", "response/length_mean"):
        assert thread[0][key] == process[0][key], key
    for h in process:
        assert h["mismatch/abs_logp_diff"] <= 2e-2  # bf16 engine against the bf16-compute trainer


def test_a_sync_run_on_cuda_with_two_engine_processes(tmp_path):
    """engine.replicas=2 on one GPU: two child processes each take the model and every update by
    CUDA IPC. At lr 1e-2 the weights move every step, so a replica left on old weights would show
    in the engine-vs-trainer mismatch; both stay within bf16 rounding of the trainer."""
    cfg = {
        "run": {"steps": 3, "eval_every": 0, "save_model": False, "seed": 5},
        "model": {"path": "tiny:nano"},
        "data": {"task": "arithmetic", "eval_size": 4},
        "rollout": {"n": 4, "batch_prompts": 8, "max_new_tokens": 12},
        "train": {"lr": 1e-2},
        "engine": {"process": True, "replicas": 2},
        "telemetry": {"console": False},
    }
    result = weir.run(cfg, [f"run.dir={tmp_path}"], reward=odd_tokens)
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 3
    assert all(h["train/grad_norm"] > 0 for h in steps)
    mismatch = [h["mismatch/abs_logp_diff"] for h in steps]
    assert max(mismatch) <= 2e-2, mismatch
