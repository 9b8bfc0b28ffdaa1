"""Prefixes shared by the sequences of one prefill are computed once: the plan, and what the engine
computes and samples with it (admission of episodes that open alike, and the KV rebuild after a
weight update)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_parity, make_prompts, wait_steps
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.engine import SamplingParams
from weir.engine.shared_prefix import plan

# sequences drawn from a few shared openings, so that real sharing is common
_openings = st.lists(st.integers(1, 4), min_size=0, max_size=12)
_sequences = st.lists(
    st.tuples(st.integers(0, 2), _openings, st.lists(st.integers(1, 4), min_size=1, max_size=6)),
    min_size=0,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(_sequences, st.lists(_openings, min_size=3, max_size=3))
def test_a_plan_groups_sequences_under_prefixes_they_start_with(parts, heads):
    seqs = [heads[h] + mid + tail for h, mid, tail in parts]
    p = plan(seqs, min_saving=0.0)
    if p is None:
        return
    lens = [len(s) for s in seqs]
    assert len(p.group) == len(seqs) and len(p.lengths) == len(p.first)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(p.group):
        if g < 0:
            continue
        members.setdefault(g, []).append(i)
        n = p.lengths[g]
        assert 1 <= n <= lens[i] - 1  # at least one token of each sequence is left to compute
        assert seqs[i][:n] == seqs[p.first[g]][:n]
    assert sorted(members) == list(range(len(p.lengths)))
    assert all(len(m) >= 2 for m in members.values())  # a prefix is worth sharing with someone
    rest = max(lens[i] - (p.lengths[g] if g >= 0 else 0) for i, g in enumerate(p.group))
    assert p.cost == len(p.lengths) * max(p.lengths) + len(seqs) * rest
    assert p.cost <= len(seqs) * max(lens)


def test_a_system_message_every_prompt_opens_with_is_computed_once():
    system, questions = list(range(10, 40)), [[50 + q] * 5 for q in range(4)]
    seqs = [system + q for q in questions for _ in range(4)]  # 16 prompts of 35 tokens
    p = plan(seqs)
    # one prefix of 30 tokens, then 5 per sequence: 30 + 16 * 5 = 110 padded tokens; the prompts'
    # own 34-token prefixes would cost 4 * 34 + 16 * 1 = 152; one forward 16 * 35 = 560
    assert p is not None and p.lengths == [30] and set(p.group) == {0}
    assert p.cost == 110


def test_sharing_that_saves_too_little_is_not_planned():
    assert plan([[1, 2, 3, 4, 5, 6, 7, 8], [1, 9, 9, 9, 9, 9, 9, 9]]) is None  # saves 1 of 16
    assert plan([[1, 2], [3, 4], [5, 6]]) is None  # nothing shared
    assert plan([[1, 2, 3]]) is None


@pytest.mark.parametrize("share", [True, False], ids=["shared", "share_prefixes=False"])
def test_episodes_that_open_alike_are_prefilled_once_with_the_same_log_probs(
    make_engine, model, share
):
    """16 requests of one sample each (a multi-turn rollout's first turns: 4 prompts x 4 episodes)
    whose prompts all open with the same 30-token system message: admitted together, the engine
    computes the system message once and 5 tokens per prompt (with ``share_prefixes=False``, every
    prompt whole), and every sampled token's log-prob is the model's own on the whole context."""
    engine = make_engine(share_prefixes=share)
    system = make_prompts(1, 30, 30, seed=40)[0]
    questions = make_prompts(4, 5, 5, seed=41)
    prompts = [system + q for q in questions for _ in range(4)]
    params = SamplingParams(n=1, max_new_tokens=12, seed=3)
    engine.pause_sync()  # all 16 arrive before the engine admits any
    futures = engine.submit_many(prompts, params)
    before = engine.stats()
    engine.resume_sync()
    results = [f.result(timeout=60) for f in futures]
    after = engine.stats()
    prefilled = after["prefill_tokens"] - before["prefill_tokens"]
    shared = after["shared_prefix_tokens"] - before["shared_prefix_tokens"]
    assert (prefilled, shared) == ((30 + 16 * 5, 16 * 35 - 110) if share else (16 * 35, 0))
    for prompt, (completion,) in zip(prompts, results, strict=True):
        assert_parity(model, prompt, completion)


def test_the_rebuild_after_a_weight_update_computes_each_prompt_once(make_engine, model):
    """After a weight update the rows in flight are prefilled again under the new weights; a
    prompt's 4 samples share it, so it is computed once, and what they sample next is exactly the
    new policy's."""
    engine = make_engine(eos_token_ids=[])
    prompts = make_prompts(2, 24, 24, seed=42)
    futures = engine.submit_many(prompts, SamplingParams(n=4, max_new_tokens=30, seed=4))
    wait_steps(engine, 5)
    engine.pause_sync()
    g = torch.Generator().manual_seed(1)
    new = [
        (n, p.detach() + 0.05 * torch.randn(p.shape, generator=g))
        for n, p in model.named_parameters()
    ]
    engine.update_weights_sync(new, version=1)
    before = engine.stats()
    engine.resume_sync()
    results = [f.result(timeout=60) for f in futures]
    after = engine.stats()
    recomputed = after["recomputed_tokens"] - before["recomputed_tokens"]
    # the cache held prompt + the tokens generated before the last: 24 + k - 1 a row; each row
    # recomputing its own prompt would be at least 8 x 24 = 192 tokens of the ~240
    one_forward = sum(24 + c.versions.index(1) - 1 for comps in results for c in comps)
    assert 0 < recomputed < one_forward / 2
    assert (
        after["shared_prefix_tokens"] - before["shared_prefix_tokens"] == one_forward - recomputed
    )
    for prompt, comps in zip(prompts, results, strict=True):
        for c in comps:
            k = c.versions.index(1)
            ref = torch.log_softmax(_logits(model, prompt, c.token_ids), -1)
            want = ref.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)[k:]
            assert (want - torch.tensor(c.logprobs[k:])).abs().max() < 1e-5


@torch.inference_mode()
def _logits(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    return model(ids).logits[0, len(prompt) - 1 : -1].float()
