"""benchmarks/gpu_trainer.py: its FLOP formulas, worked out by hand, and its CPU run (the code path
the GPU run takes, on the tiny shape), which must write every part, or say why it skipped it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

BENCH = Path(__file__).parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the script imports model_shapes from its folder
    spec = importlib.util.spec_from_file_location("gpu_trainer", BENCH / "gpu_trainer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_trainer"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_trainer"]
    sys.path.remove(str(BENCH))


TOY = dict(
    hidden_size=4,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=8,
    vocab_size=10,
    tie_word_embeddings=True,
)


def test_flop_formulas_by_hand(bench):
    # one layer: q 4x4+4, k 2x4+2, v 2x4+2, o 4x4 = 56; MLP 3 x 4 x 8 = 96; two norms 8 -> 160
    assert bench.layer_params(TOY) == 160
    params = 160 + 4 + 10 * 4  # + final norm + the tied embedding
    f = bench.step_flops(TOY, seq_lens=[3, 5], resp_lens=[2, 1], params=params)
    # model: 6 x (160 + 4) x 8 tokens + 6 x V 10 x d 4 x 3 response rows + attention
    # 12 x (6 + 15 causal pairs) x head_dim 2 x 2 heads x 1 layer = 1008
    assert f["model"] == 7872 + 720 + 1008
    assert f["6nd"] == 6 * params * 8
    # verl: 6 x (96 + 4 x (2 x 4 + 2 x 2) + 2 x 10 x 4) x 8 + 12 x (9 + 25) x 2 x 2 x 1
    assert f["verl"] == 6 * 224 * 8 + 1632


@pytest.mark.parametrize("shape", ["0.5b", "1.5b"])
def test_layer_parameters_match_the_hf_model(bench, shape):
    with torch.device("meta"):
        one = AutoModelForCausalLM.from_config(
            Qwen2Config(**{**bench.SHAPES[shape], "num_hidden_layers": 1})
        )
    assert bench.layer_params(bench.SHAPES[shape]) == sum(
        p.numel() for p in one.model.layers[0].parameters()
    )
    if shape == "0.5b":  # Qwen2.5-0.5B: 0.49B parameters, 0.36B of them not the embedding
        total = bench.layer_params(bench.SHAPES[shape]) * 24 + 896 + 151936 * 896
        assert total == 494_032_768


def test_lognormal_lengths_are_seeded_and_clipped(bench):
    args = bench.parse(["--prompts", "64", "--n", "8"])
    prompts, resp = bench.lengths(args, "lognormal", seed=3)
    assert (prompts, resp) == bench.lengths(args, "lognormal", seed=3)
    assert all(64 <= p <= 192 for p in prompts) and len(resp) == 512
    assert min(resp) >= 16 and max(resp) <= 1024
    assert 180 < sorted(resp)[256] < 340  # the median, about 256
    assert bench.lengths(args, "fixed", seed=3)[1] == [256] * 512


def test_the_cpu_run_writes_every_part(bench, tmp_path):
    out = tmp_path / "r.json"
    bench.main(["--device", "cpu", "--shapes", "tiny", "--out", str(out)])
    report = json.loads(out.read_text())
    tiny = report["shapes"]["tiny"]
    main = tiny["main"]
    assert main["tokens"] == tiny["batch"]["lognormal"]["tokens"] > 0
    assert main["tok_s"] > 0 and len(main["step_s"]) == 1 and main["warmup_s"]
    assert main["mfu_model"] is None  # no bf16 peak on a CPU
    assert tiny["profile"]["top"] and tiny["profile"]["wall_s"] > 0
    # the layout auto ran (read after the steps, not its first candidate) and the model's prices
    assert main["layout"] in main["candidates"] and main["modelled"][main["layout"]] == 1.0
    assert main["liger_in_process"] is False
    for layout in ("padded", "prefix", "packed", "varlen"):
        row = tiny["layouts"][layout]
        assert row == "main" or row["tok_s"] > 0, (layout, row)
    assert tiny["fixed"]["tokens"] == tiny["batch"]["fixed"]["tokens"]
    assert tiny["checkpointing"]["layout"] in ("padded", "varlen")  # checkpointing rules prefix out
    assert not [k for k in tiny if k.startswith("fuse_")]  # no compile on a CPU
    assert "reference" in report["head"]
    assert [t["pass"] for t in report["targets"]] == [None] * 4
    assert "cc" in report["env"] and "torch" in report["env"]


def test_an_exhausted_budget_skips_parts_and_still_writes(bench, tmp_path):
    out = tmp_path / "r.json"
    bench.main(["--device", "cpu", "--shapes", "tiny", "--budget-s", "0", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["shapes"]["tiny"]["main"]["skipped"].startswith("budget")
    assert report["skipped"] == ["tiny/main"] and len(report["targets"]) == 4


def test_a_variants_patch_holds_for_its_run_only(bench):
    """`_patch` (the compile-options variant) sets module attributes for one run and puts them
    back, whatever the run did."""
    from weir.algo import entropy
    from weir.train import fuse

    before = (dict(fuse.COMPILE_OPTIONS), dict(entropy._COMPILE_OPTIONS))
    values = bench.VARIANTS["copy_compile_autodyn"]["_patch"]
    with pytest.raises(RuntimeError), bench.patched(values):
        assert fuse.COMPILE_OPTIONS == {"dynamic": None}
        assert entropy._COMPILE_OPTIONS == {"dynamic": None}
        raise RuntimeError("the run failed")
    assert before == (fuse.COMPILE_OPTIONS, entropy._COMPILE_OPTIONS)


def test_a_kernel_fallback_is_named_beside_the_figures(bench, monkeypatch):
    """A compiled or Triton log-prob kernel that fails falls back to the eager chunks for the rest
    of the process: a row timed after that says so, or `copy_compile_triton` would report the
    chunks' time as the Triton kernel's."""
    from weir.algo import entropy as E

    monkeypatch.setattr(E, "_triton_failure", [])
    monkeypatch.setattr(E, "_compile_failure", [])
    assert bench.kernel_failures() == {}
    monkeypatch.setattr(E, "_triton_failure", ["CompilationError: at 12:4"])
    assert bench.kernel_failures() == {"triton": "CompilationError: at 12:4"}
    row = {
        "layout": "varlen",
        "step_s": [0.5],
        "tok_s": 1e5,
        "mfu_model": 0.3,
        "mfu_6nd": 0.32,
        "mfu_verl": 0.4,
        "kernel_failures": bench.kernel_failures(),
    }
    assert "FELL BACK to the eager head: {'triton': 'CompilationError: at 12:4'}" in (
        bench.summary(row)
    )
