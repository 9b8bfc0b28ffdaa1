"""A LoRA run end to end: checkpoints hold only the adapter, resume continues exactly, `weir export`
writes the merged model or the adapter, and both compute what the trained model computes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import weir
from weir.cli.main import app
from weir.train.checkpoint import list_checkpoints

peft = pytest.importorskip("peft")

CONFIG = {
    "run": {
        "steps": 4,
        "eval_every": 2,  # the shortened run evaluates at step 2 like the straight one
        "checkpoint_every": 2,
        "keep_checkpoints": 2,
        "deterministic": True,
    },
    "model": {"path": "tiny:nano", "threads": 1},
    "data": {"task": "arithmetic", "eval_size": 8},
    "rollout": {"n": 4, "batch_prompts": 4, "max_new_tokens": 6},
    "train": {"lr": 1e-2},
    "lora": {
        "enabled": True,
        "rank": 4,
        "alpha": 8,
        "target_modules": ["q_proj", "v_proj", "up_proj"],
    },
    "telemetry": {"console": False},
}
TRAIN_KEYS = ("reward/mean", "train/loss", "train/grad_norm", "policy/pg_loss", "train/entropy")


def digit_share(sample, row) -> float:
    """Random text has a varying share of digits: a reward with spread, so every step updates."""
    text = sample.response_text
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def _records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "reward/mean" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    straight = weir.run(CONFIG, [f"run.dir={root / 'straight'}"], reward=digit_share)
    weir.run(CONFIG, [f"run.dir={root / 'resumed'}", "run.steps=2"], reward=digit_share)
    resumed = weir.run(CONFIG, [f"run.dir={root / 'resumed'}"], reward=digit_share)
    base = next((root / ".models").iterdir())
    return {"straight": straight.dir, "resumed": resumed.dir, "base": base, "root": root}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


IDS = torch.tensor([[5, 40, 17, 22, 99, 120, 8, 61, 33]])


def test_checkpoints_hold_only_the_adapter(runs):
    ckpts = list_checkpoints(runs["straight"] / "checkpoints")
    assert [step for step, _ in ckpts] == [2, 4]
    model_dir = ckpts[-1][1] / "model"
    assert (model_dir / "adapter_config.json").exists()
    assert (
        not list(model_dir.glob("model*.safetensors")) and not (model_dir / "config.json").exists()
    )
    tensors = load_file(model_dir / "adapter_model.safetensors")
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    # 2 layers x 3 targets x (A, B) of the nano model
    assert len(tensors) == 2 * 3 * 2
    assert sum(t.numel() for t in tensors.values()) < 0.1 * sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(runs["base"]).parameters()
    )
    config = json.loads((model_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert Path(config["base_model_name_or_path"]) == runs["base"].resolve()
    # the final model is a plain merged HF directory, the adapter beside it
    assert (runs["straight"] / "model" / "model.safetensors").exists()
    assert (runs["straight"] / "adapter" / "adapter_model.safetensors").exists()


def test_resume_continues_exactly(runs):
    straight, resumed = _records(runs["straight"]), _records(runs["resumed"])
    assert sorted(straight) == sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):  # the steps trained after the resume
        for key in TRAIN_KEYS:
            assert resumed[step][key] == straight[step][key], (step, key)
    a = load_file(runs["straight"] / "adapter" / "adapter_model.safetensors")
    b = load_file(runs["resumed"] / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_merged_computes_what_the_trained_model_computes(runs, tmp_path):
    ckpt = list_checkpoints(runs["straight"] / "checkpoints")[-1][1]
    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["export", str(runs["straight"]), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert not (out / "adapter_config.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, no peft
    base = AutoModelForCausalLM.from_pretrained(runs["base"])
    trained = peft.PeftModel.from_pretrained(base, ckpt / "model")  # unmerged: x W + s x A B
    want = _logits(trained, IDS)
    assert torch.allclose(_logits(exported, IDS), want, atol=1e-5)
    with trained.disable_adapter():
        assert (_logits(trained, IDS) - want).abs().max() > 1e-3  # training moved the model
    assert json.loads((out / "weir_export.json").read_text())["kind"] == "lora-merged"


def test_export_adapter_loads_with_peft(runs, tmp_path):
    ckpt = list_checkpoints(runs["straight"] / "checkpoints")[-1][1]
    out = tmp_path / "adapter"
    result = CliRunner().invoke(app, ["export", str(ckpt), "--out", str(out), "--adapter"])
    assert result.exit_code == 0, result.output
    assert not (out / "model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs["base"]), out)
    saved = load_file(ckpt / "model" / "adapter_model.safetensors")
    again = load_file(out / "adapter_model.safetensors")
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
    merged = AutoModelForCausalLM.from_pretrained(runs["straight"] / "model")
    assert torch.allclose(_logits(loaded, IDS), _logits(merged, IDS), atol=1e-5)
    # a finished run without checkpoints: --adapter takes <run>/adapter, not the merged model/
    bare = tmp_path / "bare_run"
    for sub in ("model", "adapter"):
        shutil.copytree(runs["straight"] / sub, bare / sub)
    result = CliRunner().invoke(
        app, ["export", str(bare), "--out", str(tmp_path / "a2"), "--adapter"]
    )
    assert result.exit_code == 0, result.output
    final = load_file(runs["straight"] / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(final[k], saved[k]) for k in saved)  # the last checkpoint's
    assert all(
        torch.equal(final[k], v)
        for k, v in load_file(tmp_path / "a2" / "adapter_model.safetensors").items()
    )


def test_export_and_resume_mistakes_are_one_line(runs, tmp_path):
    full = tmp_path / "full"
    AutoModelForCausalLM.from_pretrained(runs["base"]).save_pretrained(full)
    result = CliRunner().invoke(
        app, ["export", str(full), "--out", str(tmp_path / "o"), "--adapter"]
    )
    assert result.exit_code == 1 and "was not trained with LoRA" in result.output
    ckpt = list_checkpoints(runs["straight"] / "checkpoints")[-1][1]
    result = CliRunner().invoke(
        app, ["export", str(ckpt), "--out", str(tmp_path / "o2"), "--base", str(tmp_path / "gone")]
    )
    assert result.exit_code == 1 and "pass --base" in result.output
    with pytest.raises(ValueError, match="holds a LoRA adapter: resume with lora.enabled=true"):
        weir.run(
            CONFIG,
            [f"run.dir={runs['straight']}", "lora.enabled=false", "run.steps=5"],
            reward=digit_share,
        )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_engine_follows_the_adapters(runs, tmp_path, mode):
    """Every step samples with the merged weights of the adapters just trained: engine and trainer
    log-probs agree to rounding at every step (with stale weights they differ by ~3e-2 here)."""
    if mode == "sync":
        records = _records(runs["straight"])
    else:  # the async loop's own engine copy, with staleness 0 so every step is on-policy
        opts = ["loop.mode=async", "run.deterministic=false", "loop.max_staleness=0"]
        opts += ["run.steps=3", "run.checkpoint_every=0", "run.save_model=false"]
        result = weir.run(CONFIG, [f"run.dir={tmp_path / 'async'}", *opts], reward=digit_share)
        records = {i: h for i, h in enumerate(result.history) if "reward/mean" in h}
        assert all(r["staleness/max"] == 0 for r in records.values())
    assert len(records) >= 3
    assert all(r["train/grad_norm"] > 0 for r in records.values())
    assert all(r["mismatch/abs_logp_diff"] < 1e-5 for r in records.values()), records
