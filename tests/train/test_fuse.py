"""`train.fuse`: the fused element-wise route the trainer takes, and the fallbacks that engage, and
say so once, where a kernel or a C compiler is missing (on CPU; the kernels themselves are checked
against eager on a GPU by tests/gpu/test_fuse_gpu.py)."""

from __future__ import annotations

import copy
import logging
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from tests.toy import toy_groups
from weir.algo.logprob_triton import c_compiler
from weir.config import build_config
from weir.train import fuse
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.fuse import apply_fusion, choose_fusion

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def _model(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture
def no_compiler(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)


@pytest.fixture
def counting_compile(monkeypatch):
    """The `compile` route with a backend that records each graph Dynamo compiles and each call of
    one: yields (graphs, calls). Dynamo's cache is emptied before and after (a layer's code object
    shares it across the process)."""
    import torch._dynamo

    graphs, calls = [], []

    def counting(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            calls.append(1)
            return gm.forward(*args)

        return run

    torch._dynamo.reset()
    monkeypatch.setattr(fuse, "COMPILE_OPTIONS", {"dynamic": True, "backend": counting})
    yield graphs, calls
    torch._dynamo.reset()


def test_auto_is_off_on_a_cpu_and_liger_falls_back_to_compile_there():
    model = _model()
    assert choose_fusion("auto", model, CPU).route == "off"
    assert choose_fusion("off", model, CPU).route == "off"
    if c_compiler() is None:
        pytest.skip("no C compiler here: the compile route is refused (tested below)")
    got = choose_fusion("liger", model, CPU)
    assert got.route == "compile"
    assert got.reason.startswith("liger off: Liger's kernels are Triton (CUDA only); ")


def test_the_chain_on_a_gpu_without_liger_or_triton(monkeypatch):
    """On CUDA without liger-kernel and Triton: auto tries compile, then liger, then off, each
    reason given."""
    real = fuse.importlib.util.find_spec
    monkeypatch.setattr(
        fuse.importlib.util,
        "find_spec",
        lambda name: None if name in ("liger_kernel", "triton") else real(name),
    )
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/cc")
    got = choose_fusion("auto", _model(), CUDA)
    assert got.route == "off"
    assert got.reason == (
        "compile off: Triton is not installed; "
        "liger off: liger-kernel is not installed (pip install --no-deps liger-kernel)"
    )
    monkeypatch.setattr(fuse.importlib.util, "find_spec", real)
    model = _model()
    model.config.model_type = "gemma2"
    if real("liger_kernel") is None:
        return
    assert "not checked on 'gemma2'" in choose_fusion("liger", model, CUDA).reason


@pytest.fixture
def every_route_installed(monkeypatch):
    """liger-kernel and Triton importable, a C compiler on PATH (what a GPU machine has)."""
    real = fuse.importlib.util.find_spec
    monkeypatch.setattr(
        fuse.importlib.util,
        "find_spec",
        lambda name: object() if name in ("liger_kernel", "triton") else real(name),
    )
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/cc")


def test_auto_prefers_compile_on_cuda_and_takes_liger_without_a_compiler(
    every_route_installed, monkeypatch
):
    """Measured on an H200 (docs/dev/gpu-runs.md): compiled layers are faster than Liger's
    kernels at both Qwen2.5 shapes, so `auto` compiles where a C compiler and Triton are there."""
    assert choose_fusion("auto", _model(), CUDA).route == "compile"
    monkeypatch.setattr(shutil, "which", lambda name: None)
    got = choose_fusion("auto", _model(), CUDA)
    assert got.route == "liger"
    assert got.reason.startswith("compile off: no C compiler on PATH")


def test_auto_leaves_an_fsdp2_rank_and_a_lora_model_unfused(every_route_installed, caplog):
    """`auto` fuses only what was measured faster on a GPU: a whole model in one process. An FSDP2
    rank (compiling took 61 s on an H100 for no faster step) and a LoRA model (no route checked on
    a GPU) stay unfused, and the reason says how to ask for a route; asked for, a route runs."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard

    from weir.train.distributed import free_port

    lora = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    got = choose_fusion("auto", lora, CUDA)
    assert (
        got.route == "off" and "LoRA" in got.reason and "train.fuse=liger or compile" in got.reason
    )
    with caplog.at_level(logging.INFO, logger=fuse.__name__):  # the default: said, not warned
        apply_fusion("auto", lora, CUDA)
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert choose_fusion("compile", lora, CUDA).route == "compile"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        sharded = fully_shard(_model())
        got = choose_fusion("auto", sharded, CUDA)
        assert got.route == "off" and "FSDP2 rank" in got.reason
        assert choose_fusion("liger", sharded, CUDA).route == "liger"
    finally:
        dist.destroy_process_group()
    assert choose_fusion("auto", _model(), CUDA).route == "compile"


def test_a_lora_model_is_fused_through_its_base_model():
    """peft wraps the transformers model: the decoder layers (LoRA layers inside them) and the
    modules Liger patches are the base model's."""
    from peft import LoraConfig, get_peft_model

    model = _model()
    layers = list(model.model.layers)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert fuse._decoder_layers(peft_model) == layers
    assert fuse._unwrapped(peft_model) is model


def test_a_missing_compiler_turns_compile_off_and_says_so_once(no_compiler, caplog):
    model = _model()
    with caplog.at_level(logging.INFO, logger=fuse.__name__):
        got = apply_fusion("compile", model, CPU)
    assert got.route == "off"
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert caplog.records[0].getMessage() == (
        "train.fuse: off (compile off: no C compiler on PATH ($CC, cc, gcc or clang) for "
        "Inductor and Triton)"
    )
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)


def test_an_actor_asked_to_compile_without_a_compiler_trains_unfused(no_compiler, caplog):
    cfg = build_config({}, ["train.fuse=compile", "rollout.batch_prompts=2", "rollout.n=4"])
    with caplog.at_level(logging.WARNING, logger=fuse.__name__):
        actor = Actor(_model(), ActorSettings.from_config(cfg))
    assert actor.fusion.route == "off"
    stats = actor.train(make_batch(toy_groups(), version=0))
    assert torch.isfinite(torch.tensor(stats["train/loss"]))
    assert len(caplog.records) == 1  # said once, at start-up, not per step


def test_compiled_layers_leave_a_deep_copy_uncompiled():
    """The reference policy and an engine's copy are deep copies of the trainer's model: they must
    run their own weights, which a compiled bound `forward` would not (it runs the original's)."""
    if c_compiler() is None:
        pytest.skip("no C compiler here")
    model = _model()
    assert apply_fusion("compile", model, CPU).route == "compile"  # compiles lazily: no forward
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    twin = copy.deepcopy(model)
    assert all(layer._compiled_call_impl is None for layer in twin.model.layers)


def test_a_forward_with_a_kv_cache_runs_uncompiled_and_leaves_the_graph_to_training(
    counting_compile,
):
    """The `prefix` layout's forwards carry a KV cache; through compiled layers Dynamo guarded on
    the cache entry of each layer's index, so each layer took a graph of its own until the eighth
    hit `recompile_limit`, and every later call that missed those graphs ran uncompiled: the
    training forwards of an FSDP2 rank, which probes `prefix` at its first forward, ran eagerly
    (a GPU run's log: "hit config.recompile_limit (8)", last reason
    `past_key_values.layers[7].is_initialized`). Twelve layers, more than the limit: the prefix
    forward compiles nothing, and the padded forward after it runs one compiled graph for all."""
    from weir.train.packing import padded_response_logprobs
    from weir.train.prefix_pass import prefix_response_logprobs

    graphs, calls = counting_compile
    model = _model(layers=12)
    eager = copy.deepcopy(model)
    assert apply_fusion("compile", model, CPU).route == "compile"
    seqs = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12], [13, 14, 15, 16]]
    lens = [3, 2, 2]
    with torch.no_grad():
        got = prefix_response_logprobs(model, seqs, lens).logprobs
        want = prefix_response_logprobs(eager, seqs, lens).logprobs
        assert graphs == [] and calls == []
        padded = padded_response_logprobs(model, seqs, lens).logprobs
        assert len(graphs) == 1 and len(calls) == 12  # every layer ran the one graph
        padded_eager = padded_response_logprobs(eager, seqs, lens).logprobs
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(padded, padded_eager, atol=1e-6, rtol=0)


def test_compiled_layers_take_every_micro_batch_shape_with_one_graph(monkeypatch, counting_compile):
    """A run's `varlen` micro-batches differ in tokens, in sequences and in the longest sequence,
    step after step. The compiled decoder layers must take them all with the one graph: a graph
    per shape would reach Dynamo's `recompile_limit` (8) within a few steps, and every
    micro-batch after it would run uncompiled without a word. On a CPU the FlashAttention-2
    kernel is stood in for by a custom op of its signature (SDPA per sequence inside, opaque to
    Dynamo as the real op is), so that the layer's graph holds the call a GPU makes."""
    from weir.train import varlen
    from weir.train.packing import packed_response_logprobs

    @torch.library.custom_op("weir_test::varlen_attn", mutates_args={})
    def stand_in(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        scale: float,
        enable_gqa: bool,
    ) -> torch.Tensor:
        return varlen._per_sequence(q, k, v, cu_q, scale, None)

    @stand_in.register_fake
    def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, enable_gqa):
        return torch.empty_like(q)

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, scale, enable_gqa):
        assert window_size == (-1, 0)  # causal, no window
        return stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale, enable_gqa)

    graphs, calls = counting_compile
    monkeypatch.setattr(varlen, "_kernel", lambda: (kernel, frozenset(("window_size", "scale", "enable_gqa"))))  # fmt: skip
    monkeypatch.setattr(varlen, "flash_runs", lambda device, dtype, head_dim: True)
    model = _model(layers=3)
    eager = copy.deepcopy(model)
    assert apply_fusion("compile", model, CPU).route == "compile"
    g = torch.Generator().manual_seed(0)
    micro_batches = [(2, 9), (3, 17), (5, 6), (4, 30), (7, 12), (2, 41), (6, 23), (3, 8), (9, 15)]
    with torch.no_grad():
        for count, longest in micro_batches:  # 9 shapes: one more than the limit
            lengths = [longest, *torch.randint(3, longest + 1, (count - 1,), generator=g)]
            seqs = [torch.randint(2, 256, (int(n),), generator=g).tolist() for n in lengths]
            lens = [max(1, len(s) // 3) for s in seqs]
            got = packed_response_logprobs(model, seqs, lens, varlen=True).logprobs
            want = packed_response_logprobs(eager, seqs, lens, varlen=True).logprobs
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert len(graphs) == 1
    assert len(calls) == 3 * len(micro_batches)  # every layer of every micro-batch ran it
