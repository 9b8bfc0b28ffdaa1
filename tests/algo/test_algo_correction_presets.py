"""Mismatch-correction presets and the ratio-spread diagnostic, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from weir.algo import (
    CORRECTION_PRESETS,
    RECOMMENDABLE,
    mismatch_diagnostics,
    preset_settings,
    recommend_preset,
    rollout_correction,
)
from weir.config.schema import CorrectionConfig
from weir.train.actor_settings import correction_settings

# three sequences of two trained tokens; d = train - rollout per token:
#   A: +0.5, -0.8      rho = 1.6487213, 0.4493290   rho_seq = e^-0.3 = 0.7408182   rho_geo = e^-0.15 = 0.8607080
#   B: +1.0, +0.2      rho = 2.7182818, 1.2214028   rho_seq = e^1.2 = 3.3201169    rho_geo = e^0.6 = 1.8221188
#   C: +5e-4, -3e-4    rho = 1.0005001, 0.9997000   rho_seq = e^2e-4 = 1.0002000   rho_geo = e^1e-4 = 1.0001000
ROLL = torch.tensor([[-1.0, -1.0], [-2.0, -0.5], [-0.7, -0.3]])
D = torch.tensor([[0.5, -0.8], [1.0, 0.2], [5e-4, -3e-4]])
TRAIN = ROLL + D
MASK = torch.ones(3, 2)
A_TOK, B_TOK, C_TOK = [1.6487213, 0.4493290], [2.7182818, 1.2214028], [1.0005001, 0.9997000]
SEQ = [0.7408182, 3.3201169, 1.0002000]
GEO = [0.8607080, 1.8221188, 1.0001000]

# preset -> (weights, mask) worked out from the numbers above
EXPECTED = {
    # token TIS, cap 2: only B's first token (2.718) is truncated
    "tis": ([A_TOK, [2.0, B_TOK[1]], C_TOK], [[1, 1], [1, 1], [1, 1]]),
    # sequence TIS, cap 2: B's 3.32 truncated to 2
    "seq_tis": ([[SEQ[0]] * 2, [2.0] * 2, [SEQ[2]] * 2], [[1, 1], [1, 1], [1, 1]]),
    # geometric-mean TIS, cap 2: nothing above 2
    "geo_tis": ([[GEO[0]] * 2, [GEO[1]] * 2, [GEO[2]] * 2], [[1, 1], [1, 1], [1, 1]]),
    # token rejection outside [0.5, 2]: A's 0.449 and B's 2.718 go
    "token_mask": ([[1, 0], [0, 1], [1, 1]], [[1, 0], [0, 1], [1, 1]]),
    # IcePop, [0.5, 5], weight rho inside: only A's 0.449 goes
    "icepop": ([[A_TOK[0], 0], B_TOK, C_TOK], [[1, 0], [1, 1], [1, 1]]),
    # sequence rejection outside [0.5, 2]: B (3.32) goes
    "seq_mask": ([[1, 1], [0, 0], [1, 1]], [[1, 1], [0, 0], [1, 1]]),
    # sequence MIS, [0, 2], weight rho_seq inside: B goes
    "seq_mis": ([[SEQ[0]] * 2, [0, 0], [SEQ[2]] * 2], [[1, 1], [0, 0], [1, 1]]),
    # geometric-mean rejection outside [0.999, 1.001]: only C stays
    "geo_mask": ([[0, 0], [0, 0], [1, 1]], [[0, 0], [0, 0], [1, 1]]),
}


def test_every_preset_has_a_hand_example():
    assert set(EXPECTED) == set(CORRECTION_PRESETS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_weights_and_mask(name):
    res = rollout_correction(TRAIN, ROLL, MASK, **preset_settings(name))
    weights, mask = EXPECTED[name]
    torch.testing.assert_close(
        res.weights, torch.tensor(weights, dtype=torch.float32), atol=2e-6, rtol=0
    )
    assert res.mask.int().tolist() == mask


def test_config_names_match_the_presets():
    names = CorrectionConfig.model_fields["preset"].annotation.__args__[0].__args__
    assert set(names) == set(CORRECTION_PRESETS)


def test_preset_then_explicit_keys():
    icepop = correction_settings(CorrectionConfig(preset="icepop"))
    assert icepop == {
        "mode": "token_mis",
        "cap": 2.0,
        "low": 0.5,
        "high": 5.0,
        "seq_ratio": "product",
    }
    wider = correction_settings(CorrectionConfig(preset="icepop", high=8.0))
    assert (wider["mode"], wider["low"], wider["high"]) == ("token_mis", 0.5, 8.0)
    plain = correction_settings(CorrectionConfig(mode="seq_tis", cap=3.0, seq_ratio="geometric"))
    assert plain == {
        "mode": "seq_tis",
        "cap": 3.0,
        "low": 0.5,
        "high": 2.0,
        "seq_ratio": "geometric",
    }


def test_unknown_preset_is_one_line():
    with pytest.raises(ValueError, match="did you mean 'icepop'"):
        preset_settings("icepoop")


def test_diagnostics_hand_values():
    d = mismatch_diagnostics(TRAIN, ROLL, MASK)
    # the six token ratios sorted: 0.4493 0.9997 1.0005 1.2214 1.6487 2.7183 (nearest rank)
    assert d["token_ratio_q01"] == pytest.approx(0.4493290, abs=1e-6)
    assert d["token_ratio_q99"] == pytest.approx(2.7182818, abs=1e-6)
    assert d["geo_ratio_q01"] == pytest.approx(GEO[0], abs=1e-6)
    assert d["geo_ratio_q99"] == pytest.approx(GEO[1], abs=1e-6)
    assert d["seq_logratio_q50"] == pytest.approx(2e-4, abs=1e-7)
    assert d["max_abs_logratio"] == pytest.approx(1.0, abs=1e-6)
    third = pytest.approx(1 / 3, abs=1e-6)
    assert d["outside/tis"] == pytest.approx(1 / 6, abs=1e-6)  # 2.718 > cap 2
    assert d["outside/token_mask"] == third  # 0.449 and 2.718
    assert d["outside/icepop"] == pytest.approx(1 / 6, abs=1e-6)  # 0.449 < 0.5
    assert d["outside/seq_tis"] == third and d["outside/seq_mask"] == third
    assert d["outside/seq_mis"] == third
    assert d["outside/geo_tis"] == 0.0
    assert d["outside/geo_mask"] == pytest.approx(2 / 3, abs=1e-6)
    assert RECOMMENDABLE[int(d["recommended"])] == "icepop"


def _diag(max_abs=0.1, tok_out=0.0, seq_out=0.0):
    return {"max_abs_logratio": max_abs, "outside/token_mask": tok_out, "outside/seq_mask": seq_out}


def test_recommendation_rule():
    assert recommend_preset(_diag(max_abs=5e-4)) == "none"
    assert recommend_preset(_diag(tok_out=0.002)) == "icepop"
    assert recommend_preset(_diag(tok_out=0.0005, seq_out=0.2)) == "seq_mis"
    assert recommend_preset(_diag(tok_out=0.0005, seq_out=0.01)) == "tis"


def test_exact_engine_needs_no_correction():
    lp = torch.log(torch.rand(4, 6, generator=torch.Generator().manual_seed(0)))
    d = mismatch_diagnostics(lp, lp.clone(), torch.ones(4, 6))
    assert d["max_abs_logratio"] == 0.0 and d["token_ratio_q50"] == 1.0
    assert RECOMMENDABLE[int(d["recommended"])] == "none"
    assert math.isclose(d["outside/geo_mask"], 0.0)


def test_report_line_names_the_preset():
    from weir.telemetry import report

    assert report.RECOMMENDABLE == RECOMMENDABLE
    d = {f"mismatch/{k}": v for k, v in mismatch_diagnostics(TRAIN, ROLL, MASK).items()}
    steps = {1: {"reward/mean": 0.0}, 2: d, 3: d}
    line = report.mismatch_line(steps)
    assert line.startswith("icepop (the last 2 steps: icepop, icepop)")
    assert "33.3% of tokens" in line
    assert report.mismatch_line({1: {"reward/mean": 0.0}}).startswith("–")


def test_diagnostics_of_no_trained_token_are_empty_and_rows_without_one_are_left_out():
    assert mismatch_diagnostics(TRAIN, ROLL, torch.zeros_like(MASK)) == {}
    # a row without a trained token changes neither the sequence nor the token statistics
    pad = torch.zeros(1, TRAIN.shape[1])
    wide = mismatch_diagnostics(
        torch.cat([TRAIN, pad - 3.0]), torch.cat([ROLL, pad]), torch.cat([MASK, pad])
    )
    assert wide == pytest.approx(mismatch_diagnostics(TRAIN, ROLL, MASK), abs=1e-7)
