"""Distillation on FSDP2 trainer ranks (the Ray trainer's processes, here without Ray): the teacher
is sharded like the reference, and two ranks take the step one process takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from tests.train.launch import run_ranks
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch

RANK = Path(__file__).parent / "distill_rank.py"
OPTS = ["rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-3", "model.threads=1"]


@pytest.mark.slow
def test_two_ranks_distil_as_one_process(tiny_model_dir, tmp_path):
    from weir.tasks.tiny_model import build_tiny_model

    teacher = build_tiny_model(tmp_path / "teacher", size="nano", seed=3)
    results = run_ranks(RANK, [str(tiny_model_dir), str(teacher), str(tmp_path)], 2, 600)
    for code, output in results:
        assert code == 0, output[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    cfg = build_config({}, [*OPTS, f"algo.distill.teacher={teacher}"])
    one = Actor(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), ActorSettings.from_config(cfg)
    )
    expected = one.train(make_batch(toy_groups(), version=0))
    for r in ranks:
        assert r["teacher_class"].startswith("FSDP")  # sharded, not a whole copy per rank
        for key, value in r["stats"].items():
            assert value == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
