"""The trainer's one-process shortcuts on FSDP2 ranks (two real gloo ranks, no Ray): fused old
log-probs and dead rows without backward (by default without forward too) give the full step's
update, and a non-finite log-prob on one rank restarts the step on every rank instead of hanging
the collectives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.train.launch import run_ranks
from tests.train.shortcut_rank import KEYS

WORLD = 2
ADAM_ROUNDING = 2e-4  # weights apart after AdamW steps at lr 1e-2 from rounding alone (see below)


@pytest.fixture(scope="module")
def seen(tiny_model_dir, tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("shortcut-ranks")
    script = Path(__file__).parent / "shortcut_rank.py"
    for code, o in run_ranks(script, [str(tiny_model_dir), str(out)], WORLD, timeout=240):
        assert code == 0, o[-3000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _weights(out: Path, way: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{way}.pt")


def test_shortcuts_run_on_the_ranks(seen):
    _, ranks = seen
    for r in ranks:
        assert r["full"]["logprob_passes"] == 3  # a separate old-log-prob pass per step
        assert r["default"]["logprob_passes"] == r["forward"]["logprob_passes"] == 0  # fused
    # with train.dead_rows=forward the equal-reward group's rows ran without gradients in every
    # step; by default only in the step of dead rows only (so that it has its metrics)
    assert (
        0
        < sum(r["default"]["nograd_forwards"] for r in ranks)
        < sum(r["forward"]["nograd_forwards"] for r in ranks)
    )
    for way in ("default", "forward"):
        assert sum(r[way]["grad_forwards"] for r in ranks) < sum(
            r["full"]["grad_forwards"] for r in ranks
        )


def test_shortcut_update_equals_the_full_step(seen, tiny_model_dir):
    out, ranks = seen
    for way in ("default", "forward"):
        for got, want in zip(ranks[0][way]["stats"], ranks[0]["full"]["stats"], strict=True):
            # the default step's entropy covers the trained rows only
            for key in KEYS if way == "forward" else set(KEYS) - {"train/entropy"}:
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (way, key)
    full = _weights(out, "full")
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert max((full[k] - start[k]).abs().max().item() for k in full) > 1e-3  # it trained
    # AdamW's first steps move each weight by about lr * sign(g) (lr 1e-2 here), so the
    # rounding-level gradient differences of another micro-batch order show amplified where a
    # gradient cancels to near zero: 3.6e-5 on an AMD EPYC, under 1e-5 on the CPU this was first
    # run on. A wrong update (a dead row's loss or normaliser leaking in) moves weights by ~lr.
    for way in ("default", "forward"):
        got = _weights(out, way)
        assert set(got) == set(full)
        assert max((full[k] - got[k]).abs().max().item() for k in full) < ADAM_ROUNDING, way


def test_the_prefix_layout_on_ranks_trains_what_one_process_trains(seen, tiny_model_dir):
    """Whole prompt groups dealt to the ranks, each prompt run once: the same update as the
    padded full step, and no collective out of step (the ranks would hang)."""
    out, ranks = seen
    assert all(r["prefix"]["layout"] == "prefix" for r in ranks)
    for got, want in zip(ranks[0]["prefix"]["stats"], ranks[0]["full"]["stats"], strict=True):
        for key in set(KEYS) - {"train/entropy"}:  # the default step's entropy: trained rows
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    # the same layout in one process, unsharded: the same weights, every parameter moved (the
    # norms and the tied embedding / LM head too: FSDP2 once left the root module's gradients
    # behind when two root forwards shared a backward). AdamW's first steps move each weight by
    # about lr * sign(g), so rounding-level gradient differences show amplified where a gradient
    # is near zero: the padded layout's ranks against its one-process run differ by about 2e-5
    # here, one-process prefix against padded by about 2e-4.
    one, got = _weights(out, "prefix_one"), _weights(out, "prefix")
    assert set(got) == set(one)
    assert max((one[k] - got[k]).abs().max().item() for k in one) < ADAM_ROUNDING
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert min((got[k] - start[k]).abs().max().item() for k in got) > 1e-3


def test_a_non_finite_log_prob_on_one_rank_restarts_the_step_on_both(seen):
    out, ranks = seen
    # both ranks fell back to the two-pass step once (step 1), then fused again (step 2)
    assert [r["injected"]["logprob_passes"] for r in ranks] == [1, 1]
    full, injected = _weights(out, "full"), _weights(out, "injected")
    assert max((full[k] - injected[k]).abs().max().item() for k in full) < ADAM_ROUNDING
