"""Behaviour log-probs under top-k / top-p: the engine reports, besides the full-vocabulary
log-prob, the log-prob under the truncated, renormalised distribution each token was drawn from;
the corrections weigh against that one (algo.behavior_logprobs), and a config that cannot be right
gets a warning."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from engine_helpers import assert_parity, full_logits, make_prompts

from weir.config import build_config
from weir.engine import SamplingParams


def _kept_logmass(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """log of the probability mass top-k then top-p keep, per row, computed by sorting by hand:
    top-k keeps the k most likely tokens; top-p keeps, in that order, each token while the mass
    before it is below p times the top-k mass."""
    out = []
    for row in probs:
        ordered = sorted(row.tolist(), reverse=True)
        if top_k:
            ordered = ordered[:top_k]
        total, kept = sum(ordered), 0.0
        for p in ordered:
            if kept >= top_p * total:
                break
            kept += p
        out.append(math.log(kept))
    return torch.tensor(out)


@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature"), [(3, 1.0, 1.5), (0, 0.6, 0.8), (5, 0.7, 1.0)]
)
def test_sampled_logprobs_are_under_the_truncated_distribution(
    engine, model, top_k, top_p, temperature
):
    prompts = make_prompts(3, 4, 16, seed=21)
    params = SamplingParams(
        n=4, top_k=top_k, top_p=top_p, temperature=temperature, max_new_tokens=10
    )
    for prompt, comps in zip(prompts, engine.generate_many(prompts, params), strict=True):
        for c in comps:
            assert_parity(model, prompt, c, temperature=temperature)  # full log-probs unchanged
            probs = torch.softmax(
                full_logits(model, prompt, c.token_ids).double() / temperature, -1
            )
            full = probs.log().gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            expected = full - _kept_logmass(probs, top_k, top_p).double()
            assert c.sampled_logprobs is not None
            assert torch.allclose(torch.tensor(c.sampled_logprobs).double(), expected, atol=1e-4)
            assert all(s >= f - 1e-6 for s, f in zip(c.sampled_logprobs, c.logprobs, strict=True))


def test_unfiltered_rows_beside_filtered_ones_report_no_sampled_logprobs(engine, model):
    prompts = make_prompts(4, 4, 12, seed=22)
    params = [
        SamplingParams(temperature=1.0, top_k=4 if i % 2 else 0, max_new_tokens=8) for i in range(4)
    ]
    results = engine.generate_many(prompts, params)
    for sp, (c,) in zip(params, results, strict=True):
        if sp.top_k:
            assert c.sampled_logprobs is not None and len(c.sampled_logprobs) == len(c.token_ids)
        else:
            assert c.sampled_logprobs is None


def test_full_behavior_logprobs_with_truncated_sampling_and_a_correction_warns():
    base = {"data": {"task": "arithmetic"}, "algo": {"correction": {"mode": "token_tis"}}}
    with pytest.warns(UserWarning, match="algo.behavior_logprobs=sampled"):
        build_config(base, ["rollout.top_p=0.9", "algo.behavior_logprobs=full"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_config(base, ["rollout.top_p=0.9"])  # sampled: right, no warning
        build_config(base, ["algo.behavior_logprobs=full"])  # no truncation: the same numbers
