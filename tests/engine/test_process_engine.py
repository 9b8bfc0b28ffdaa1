"""The built-in engine in a child process (`weir.engine.process_engine`): the same completions as in
the trainer's process, weight updates through shared memory, control, checkpoint state, and a
child that dies."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time

import pytest
import torch
from engine_helpers import EOS, PAD, assert_parity, make_prompts, perturbed

from weir.config.devices import apply_backend_flags, backend_flags
from weir.engine import TorchEngine
from weir.engine.base import SamplingParams
from weir.engine.process_engine import EngineProcessDied, ProcessEngine, start_method

PARAMS = SamplingParams(n=3, temperature=1.0, max_new_tokens=12)


@pytest.fixture
def proc_engine(model):
    # the child computes with this process's thread count: bit-equal results need the same
    # reduction order (WEIR_TEST_TORCH_THREADS=2 runs the suite with 2)
    eng = ProcessEngine(
        copy.deepcopy(model),
        eos_token_ids=[EOS],
        pad_token_id=PAD,
        seed=7,
        num_threads=torch.get_num_threads(),
    )
    yield eng
    eng.close()


def test_same_completions_as_the_engine_in_this_process(model, proc_engine):
    prompts = make_prompts(5, 3, 20, seed=1)
    with TorchEngine(copy.deepcopy(model), eos_token_ids=[EOS], pad_token_id=PAD, seed=7) as local:
        want = local.generate_many(prompts, PARAMS)
    got = proc_engine.generate_many(prompts, PARAMS)
    assert [[c.token_ids for c in cs] for cs in got] == [[c.token_ids for c in cs] for cs in want]
    assert [[c.logprobs for c in cs] for cs in got] == [[c.logprobs for c in cs] for cs in want]
    assert proc_engine.pid != os.getpid()
    assert proc_engine.vocab_size == local.vocab_size
    assert proc_engine.dtype == torch.float32


def test_the_child_owns_its_weights_once_started(model):
    """The model reaches the child through memory this process holds (shared memory here, CUDA IPC
    on a GPU); once started, the child must not depend on it."""
    prompts = make_prompts(2, 4, 8, seed=5)
    handed = copy.deepcopy(model)
    with ProcessEngine(handed, eos_token_ids=[EOS], pad_token_id=PAD, seed=1) as eng:
        with torch.no_grad():
            for p in handed.parameters():
                p.zero_()
        for prompt, completions in zip(prompts, eng.generate_many(prompts, PARAMS), strict=True):
            for c in completions:
                assert_parity(model, prompt, c)


def test_weight_updates_reach_the_child_and_later_samples_are_the_new_policy(model, proc_engine):
    prompts = make_prompts(3, 4, 10, seed=2)
    for version in (1, 2):  # the second update reuses the shared buffers of the first
        new = perturbed(model, seed=version)
        asyncio.run(proc_engine.update_weights(new.items(), version))
        assert proc_engine.version == version
        reference = copy.deepcopy(model)
        reference.load_state_dict(new, strict=False)
        for prompt, completions in zip(
            prompts, proc_engine.generate_many(prompts, PARAMS), strict=True
        ):
            for c in completions:
                assert set(c.versions) == {version}
                assert_parity(reference, prompt, c)
    # the trainer's tensors stay where they were: the update copies them, it does not move them
    assert not any(p.is_shared() for p in model.parameters())


def test_async_generate_pause_drain_and_stats(proc_engine):
    prompts = make_prompts(4, 3, 8, seed=3)

    async def main():
        return await asyncio.gather(*(proc_engine.generate(p, PARAMS) for p in prompts))

    out = asyncio.run(main())
    assert [len(cs) for cs in out] == [3] * 4
    stats = proc_engine.stats()
    assert stats["requests"] == 4
    assert stats["generated_tokens"] == sum(len(c.token_ids) for cs in out for c in cs)
    proc_engine.pause_sync()
    fut = proc_engine.submit(prompts[0], PARAMS)
    time.sleep(0.3)
    assert not fut.done()  # paused: admitted, not decoded
    proc_engine.resume_sync()
    assert len(fut.result(timeout=30)) == 3
    assert proc_engine.drain_sync(timeout=10) is True
    proc_engine.resume_sync()


def test_checkpoint_state_round_trips_and_repeats_the_samples(proc_engine):
    prompt = make_prompts(1, 5, 5, seed=4)[0]
    state = proc_engine.state_dict()
    first = proc_engine.generate_many([prompt], PARAMS)[0]
    proc_engine.load_state_dict(state)
    again = proc_engine.generate_many([prompt], PARAMS)[0]
    assert [c.token_ids for c in again] == [c.token_ids for c in first]


def test_errors_come_back_as_the_engines_own(proc_engine):
    with pytest.raises(ValueError, match="empty"):
        proc_engine.generate_many([[]], PARAMS)
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        proc_engine.generate_many([[5, 6]], [PARAMS, PARAMS])
    with pytest.raises(KeyError, match="no parameter or buffer"):
        proc_engine.update_weights_sync([("nope", torch.zeros(2))], 1)
    assert proc_engine.version == 0
    assert proc_engine.generate_many([[5, 6, 7]], PARAMS)[0]  # still serving


def test_a_child_that_dies_fails_every_call_in_flight_and_after(model):
    eng = ProcessEngine(copy.deepcopy(model), eos_token_ids=[EOS], pad_token_id=PAD)
    try:
        eng.pause_sync()  # so the request is surely still in flight when the child is killed
        fut = eng.submit([5, 6, 7], PARAMS)
        os.kill(eng.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessDied, match="exited with code -9"):
            fut.result(timeout=30)
        with pytest.raises(EngineProcessDied):
            eng.stats()
    finally:
        eng.close()


def test_an_engine_that_cannot_start_raises_its_error_in_the_parent(model):
    with pytest.raises(ValueError, match="max_batch_size"):
        ProcessEngine(copy.deepcopy(model), eos_token_ids=[EOS], pad_token_id=PAD, max_batch_size=0)


def test_the_child_runs_under_this_process_torch_backend_settings(model):
    """TF32, the attention backends and deterministic algorithms are per process: a spawned child
    starts from torch's defaults unless it is given the parent's."""
    saved = backend_flags()
    changed = {
        **saved,
        "float32_matmul_precision": "high",
        "cuda_matmul_allow_tf32": True,
        "cudnn_sdp": False,
        "flash_sdp": False,
        "deterministic": True,
        "deterministic_warn_only": True,
    }
    try:
        apply_backend_flags(changed)
        assert backend_flags() == changed
        with ProcessEngine(copy.deepcopy(model), eos_token_ids=[EOS], pad_token_id=PAD) as eng:
            assert eng.backends == changed
    finally:
        apply_backend_flags(saved)
    assert backend_flags() == saved


def test_a_cpu_child_forks_warm_and_takes_the_environment_of_its_start(model, monkeypatch):
    """On a CPU the child is forked from the fork server, which imported the engine's modules
    once: no child pays for importing torch and transformers. It still runs in the environment
    the parent has when it makes the engine, not the one the fork server started with. On CUDA
    the child is spawned (a forked process cannot use CUDA)."""
    assert start_method(model) == "forkserver"
    prompts = make_prompts(2, 3, 8, seed=3)
    for value in ("first", "second"):  # the fork server is started by the first, if not before
        monkeypatch.setenv("WEIR_TEST_CHILD_ENV", value)
        with ProcessEngine(copy.deepcopy(model), eos_token_ids=[EOS], pad_token_id=PAD) as eng:
            assert eng.preloaded
            assert eng.generate_many(prompts, PARAMS)[0]
            assert eng.child_getenv("WEIR_TEST_CHILD_ENV") == value


def test_a_model_of_more_tensors_than_a_fork_server_passes_gets_a_spawned_child(model):
    """The fork server hands a child at most 255 file descriptors, one per tensor storage: a real
    model (Qwen2.5-0.5B has about 290 tensors) goes to a spawned child, which serves as before."""
    from transformers import AutoModelForCausalLM

    settings = {**model.config.to_dict(), "num_hidden_layers": 30}  # 11 tensors a layer
    settings.pop("layer_types", None)
    config = type(model.config)(**settings)
    big = AutoModelForCausalLM.from_config(config).eval()
    assert len([*big.parameters(), *big.buffers()]) > 256 and start_method(big) == "spawn"
    with ProcessEngine(big, eos_token_ids=[EOS], pad_token_id=PAD) as eng:
        assert not eng.preloaded
        assert eng.generate_many(make_prompts(2, 3, 8, seed=4), PARAMS)[0]
