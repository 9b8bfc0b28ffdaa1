"""The checkpoint store: atomic directories, manifests that catch corruption, keep-last-k, and export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from weir.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    prune,
    verify_checkpoint,
    write_checkpoint,
)


def _writer(payload: bytes):
    def write(d: Path) -> None:
        (d / "sub").mkdir()
        (d / "a.bin").write_bytes(payload)
        (d / "sub" / "b.txt").write_text("hello")

    return write


def test_write_verify_and_keep_last_k(tmp_path):
    for step in (1, 2, 3, 4):
        write_checkpoint(tmp_path, step, _writer(bytes([step]) * 100), keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    path, broken = latest_checkpoint(tmp_path)
    assert path == tmp_path / "step_00000004" and broken == []
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 4 and set(manifest["files"]) == {"a.bin", "sub/b.txt"}
    assert verify_checkpoint(path) is None


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
        (lambda p: (p / "manifest.json").write_text("{not json"), "unreadable"),
        (lambda p: (p / "sub" / "b.txt").unlink(), "sub/b.txt is missing"),
        (lambda p: (p / "a.bin").write_bytes(b"\x00" * 50), "has 50 bytes"),
        (lambda p: (p / "a.bin").write_bytes(b"\x07" * 100), "does not match its checksum"),
    ],
)
def test_damaged_newest_checkpoint_is_reported_and_skipped(tmp_path, damage, reason):
    write_checkpoint(tmp_path, 1, _writer(b"\x01" * 100))
    write_checkpoint(tmp_path, 2, _writer(b"\x02" * 100))
    damage(tmp_path / "step_00000002")
    path, broken = latest_checkpoint(tmp_path)
    assert path == tmp_path / "step_00000001"
    assert [b.path.name for b in broken] == ["step_00000002"]
    assert reason in broken[0].reason


def test_a_failed_write_leaves_the_previous_checkpoints_alone(tmp_path):
    write_checkpoint(tmp_path, 1, _writer(b"\x01" * 10))

    def explode(d: Path) -> None:
        (d / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path, 2, explode)
    assert latest_checkpoint(tmp_path)[0] == tmp_path / "step_00000001"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]


def test_prune_removes_leftovers_of_killed_writes(tmp_path):
    write_checkpoint(tmp_path, 1, _writer(b"\x01"))
    leftover = tmp_path / ".tmp-step_00000002-999999"
    leftover.mkdir()
    (leftover / "a.bin").write_bytes(b"x")
    prune(tmp_path, keep=5)
    assert not leftover.exists()
    assert (tmp_path / "step_00000001").exists()


@pytest.mark.hf_compat  # also run against the oldest supported transformers
def test_export_round_trip_generates_with_transformers(tmp_path, tiny_model_dir):
    """A run checkpoint exported with `weir export` loads in plain transformers, generates, and its
    logits equal the trainer's on the checkpointed weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from typer.testing import CliRunner

    from weir.cli.main import app
    from weir.loop.checkpointing import load_weights
    from weir.train.model import load_model

    model, tokenizer = load_model(str(tiny_model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # "trained" weights, different from the base model
    from weir.train.model import save_model

    write_checkpoint(
        tmp_path / "run" / "checkpoints", 7, lambda d: save_model(model, tokenizer, d / "model")
    )

    out = tmp_path / "exported"
    result = CliRunner().invoke(app, ["export", str(tmp_path / "run"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert json.loads((out / "weir_export.json").read_text())["source"]["step"] == 7

    hf_tok = AutoTokenizer.from_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.config.use_cache is True
    ids = hf_tok.apply_chat_template(
        [{"role": "user", "content": "12+30="}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    generated = hf.generate(**ids, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > ids["input_ids"].shape[1]
    assert isinstance(hf_tok.decode(generated[0, ids["input_ids"].shape[1] :]), str)

    fresh, _ = load_model(str(tiny_model_dir))
    load_weights(fresh, out)
    with torch.no_grad():
        expected = model(input_ids=ids["input_ids"]).logits
        assert torch.allclose(hf(input_ids=ids["input_ids"]).logits, expected, atol=1e-6)
        assert torch.allclose(fresh(input_ids=ids["input_ids"]).logits, expected, atol=1e-6)


def test_export_names_what_is_wrong(tmp_path):
    from typer.testing import CliRunner

    from weir.cli.main import app

    result = CliRunner().invoke(
        app, ["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 1 and "no such checkpoint" in " ".join(result.output.split())
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(
        app, ["export", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 1 and "holds no checkpoint" in " ".join(result.output.split())
