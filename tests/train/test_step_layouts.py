"""The trainer step on CPU: the `prefix` layout (one forward per distinct prompt) and old log-probs
taken from the update's own forward give the padded two-pass step's log-probs, gradients and
metrics, for a fraction of its operations on a GRPO batch of many short sequences."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, Qwen3Config

from weir.config import build_config
from weir.data.sample import Group, Sample
from weir.train import prefix_pass
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.packing import (
    choose_layout,
    prefix_micro_batches,
    prefix_supported,
    response_logprobs,
)
from weir.train.prefix_pass import response_buckets

VOCAB = 97
MARK = VOCAB - 1


def _config(**extra) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        **extra,
    )


def _model(seed: int = 0, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(**extra)).eval()


_MODEL = _model()


def _groups(rnd: random.Random, shapes: list[tuple[int, list[int]]]):
    """Sequences of prompt groups: (prompt length, [response lengths]) each."""
    seqs, lens = [], []
    for p, responses in shapes:
        prompt = [rnd.randrange(VOCAB) for _ in range(p)]
        for n in responses:
            seqs.append(prompt + [rnd.randrange(VOCAB) for _ in range(n)])
            lens.append(n)
    return seqs, lens


def _run(layout: str, seqs, lens, temperature: float):
    _MODEL.zero_grad(set_to_none=True)
    out = response_logprobs(
        _MODEL,
        seqs,
        lens,
        layout=layout,
        temperature=temperature,
        with_entropy=True,
        entropy_grad=True,
        pad_to=max(lens) + 2,
        chunk_size=5,
    )
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    return out, torch.cat([p.grad.reshape(-1) for p in _MODEL.parameters()])


@settings(max_examples=10, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 9), st.lists(st.integers(1, 7), min_size=1, max_size=4)),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from([1.0, 0.7]),
    st.randoms(use_true_random=False),
)
@pytest.mark.hf_compat  # also run against the oldest supported transformers
@pytest.mark.parametrize("pass_tokens", [0, 10**9], ids=["a-pass-per-length", "one-pass"])
def test_prefix_layout_gives_the_padded_logprobs_entropy_and_gradients(
    pass_tokens, shapes, temperature, rnd
):
    seqs, lens = _groups(rnd, shapes)
    rnd.shuffle(order := list(range(len(seqs))))  # group members need not be adjacent
    seqs, lens = [seqs[i] for i in order], [lens[i] for i in order]
    saved, prefix_pass.RESPONSE_PASS_TOKENS = prefix_pass.RESPONSE_PASS_TOKENS, pass_tokens
    try:
        prefix, g_prefix = _run("prefix", seqs, lens, temperature)
    finally:
        prefix_pass.RESPONSE_PASS_TOKENS = saved
    padded, g_padded = _run("padded", seqs, lens, temperature)
    assert torch.allclose(prefix.logprobs, padded.logprobs, atol=1e-5)
    assert torch.allclose(prefix.entropy, padded.entropy, atol=1e-5)
    assert torch.allclose(g_prefix, g_padded, atol=1e-5, rtol=1e-4)
    for i, n in enumerate(lens):  # positions past each response are exactly zero
        assert torch.all(prefix.logprobs[i, n:] == 0) and torch.all(prefix.entropy[i, n:] == 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=9), st.integers(0, 40))
def test_response_buckets_are_the_cheapest_split_into_runs(lengths, pass_tokens):
    lengths = sorted(lengths, reverse=True)
    buckets = response_buckets(lengths, pass_tokens)
    assert [lo for lo, _ in buckets] == [0] + [hi for _, hi in buckets[:-1]]
    assert buckets[-1][1] == len(lengths)

    def cost(parts):
        return sum(
            (hi - lo) * (lengths[lo] - 1) + pass_tokens if lengths[lo] > 1 else 0
            for lo, hi in parts
        )

    # every split into runs, by brute force over the 2^(n-1) sets of cut points
    n, cheapest = len(lengths), None
    for mask in range(1 << (n - 1)):
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        c = cost(list(zip(cuts, cuts[1:], strict=False)))
        cheapest = c if cheapest is None else min(cheapest, c)
    assert cost(buckets) == cheapest
    if pass_tokens == 0:  # free passes: no row is padded at all
        assert all(len(set(lengths[lo:hi])) == 1 or lengths[lo] == 1 for lo, hi in buckets)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.lists(st.integers(1, 60), min_size=1, max_size=6)),
        min_size=1,
        max_size=8,
    ),
    st.integers(16, 600),
    st.randoms(use_true_random=False),
)
def test_prefix_micro_batches_cover_every_row_within_the_budget(shapes, budget, rnd):
    seqs, lens = _groups(rnd, shapes)
    bins = prefix_micro_batches(seqs, lens, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(seqs)))
    prompt = {i: tuple(s[: len(s) - n]) for i, (s, n) in enumerate(zip(seqs, lens, strict=True))}
    for b in bins:
        prompts = {prompt[i] for i in b}
        cost = len(prompts) * max(map(len, prompts)) + len(b) * (max(lens[i] for i in b) - 1)
        # over the budget only when a single prompt's one response is (a group cannot shrink more)
        assert cost <= budget or (len(prompts) == 1 and len(b) == 1)
    # a prompt group is split only when it cannot fit in one micro-batch
    for p in set(prompt.values()):
        rows = [i for i in prompt if prompt[i] == p]
        whole = len(p) + len(rows) * (max(lens[i] for i in rows) - 1)
        if whole <= budget:
            assert sum(any(i in b for i in rows) for b in bins) == 1


def test_auto_picks_prefix_for_shared_prompts_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="weir.train.packing"):
        assert choose_layout(_MODEL, "auto", shared_prompts=True) == "prefix"
        assert choose_layout(_MODEL, "auto") == "padded"  # SFT: no shared prompts
    assert "prefix micro-batches" in caplog.text and "prefix on (probe within" in caplog.text
    assert choose_layout(_MODEL, "prefix") == "prefix"
    windowed = _model(use_sliding_window=True, sliding_window=4)
    assert prefix_supported(windowed) == (False, "prefix off: windowed attention")
    assert choose_layout(windowed, "auto", shared_prompts=True) == "padded"
    with pytest.raises(ValueError, match="train.packing=prefix: prefix off: windowed attention"):
        choose_layout(windowed, "prefix")
    checkpointed = _model()
    checkpointed.gradient_checkpointing_enable()
    assert not prefix_supported(checkpointed)[0]


def _grpo_batch(prompts: int, n: int, seed: int, marker: tuple[int, int] | None = None):
    return make_batch(_grpo_groups(prompts, n, seed, marker), version=0)


def _grpo_groups(prompts: int, n: int, seed: int, marker: tuple[int, int] | None = None):
    """`prompts` groups of `n`: 8-token prompts, 2-5 token answers (the demo's shape), rewards
    0/1 (every third group all 1: zero advantage), engine log-probs of about -4. `marker`
    (sample, token) puts token MARK into one sample's response (it is drawn nowhere else)."""
    rnd = random.Random(seed)
    groups = []
    for g in range(prompts):
        prompt = [rnd.randrange(1, MARK) for _ in range(8)]
        samples = []
        for i in range(n):
            resp = [rnd.randrange(1, MARK) for _ in range(rnd.randint(2, 5))]
            if marker is not None and g * n + i == marker[0]:
                resp[marker[1]] = MARK
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=resp,
                    rollout_logprobs=[-4.0 - 0.1 * rnd.random() for _ in resp],
                    versions=[0] * len(resp),
                    reward=1.0 if g % 3 == 0 else float(rnd.random() < 0.5),
                    group_id=g,
                    index=i,
                )
            )
        groups.append(Group(samples=samples, group_id=g))
    return groups


def _actor(packing: str, *, fused: bool, dead: bool, dead_rows: str = "forward") -> Actor:
    """An actor with old log-probs recomputed; `fused`: from the update's forward; `dead`: rows of
    zero advantage without backward (and, with `dead_rows=skip`, without forward)."""
    cfg = build_config(
        {}, [f"train.packing={packing}", "train.lr=1e-3", f"train.dead_rows={dead_rows}"]
    )
    actor = Actor(_model(seed=1), ActorSettings.from_config(cfg))
    actor.fuses_old_logprobs, actor.skips_dead_backward = fused, dead
    return actor


def _step(actor: Actor, batch) -> tuple[dict[str, float], torch.Tensor, float]:
    with FlopCounterMode(display=False) as counter:
        stats = actor.train(batch)
    grads = torch.cat([p.grad.reshape(-1) for p in actor.model.parameters()])
    return stats, grads, counter.get_total_flops()


METRICS = ("train/loss", "train/entropy", "policy/pg_loss", "policy/approx_kl", "policy/ratio_mean")


def test_cpu_step_costs_a_fraction_of_the_padded_two_pass_step_and_trains_the_same():
    """16 prompts x 8 answers of 2-5 tokens, old log-probs recomputed, one update. Baseline (the
    step before issue 17): padded rows, a separate no-grad pass for the old log-probs, backward
    through every row: 4 forward-equivalents over 128 rows of 10-13 tokens. `auto` on CPU: one
    forward over 16 prompts of 8 tokens plus 128 answers of 1-4 run tokens (about a third of the
    tokens), and the backward (2 more) only for the 2/3 of rows with a non-zero advantage."""
    batch = _grpo_batch(16, 8, seed=0)
    base = _actor("padded", fused=False, dead=False)
    auto = _actor("auto", fused=True, dead=True)
    assert (base.layout, auto.layout) == ("padded", "prefix")
    s_base, g_base, f_base = _step(base, batch)
    s_auto, g_auto, f_auto = _step(auto, batch)
    assert f_auto < 0.3 * f_base, (f_auto, f_base)
    assert torch.allclose(g_auto, g_base, atol=1e-6, rtol=1e-4)
    for key in (*METRICS, "mismatch/abs_logp_diff", "mismatch/kl"):
        assert s_auto[key] == pytest.approx(s_base[key], rel=1e-4, abs=1e-6), key
    assert s_auto["train/nonfinite_logprob_samples"] == 0.0
    # each shortcut alone: the same gradient for fewer operations than the prefix layout without it
    _, g_none, f_none = _step(_actor("auto", fused=False, dead=False), batch)
    for fused, dead in ((True, False), (False, True)):
        stats, g, f = _step(_actor("auto", fused=fused, dead=dead), batch)
        assert f < 0.9 * f_none and torch.allclose(g, g_base, atol=1e-6, rtol=1e-4)
        for key in METRICS:
            assert stats[key] == pytest.approx(s_base[key], rel=1e-4, abs=1e-6), key


def test_skipping_dead_rows_trains_the_same_and_measures_the_trained_rows():
    """`train.dead_rows=skip` (the default) runs no forward for rows of zero advantage: the same
    gradient for fewer operations, and the per-token metrics are those of the trained rows alone,
    i.e. those of a step on a batch holding only the groups whose rewards differ."""
    groups = _grpo_groups(16, 8, seed=0)
    live = [g for g in groups if len({s.reward for s in g.samples}) > 1]
    dead_share = 1 - sum(len(g.samples) for g in live) / sum(len(g.samples) for g in groups)
    assert 0.3 < dead_share < 0.5
    batch = make_batch(groups, version=0)
    s_full, g_full, f_full = _step(_actor("auto", fused=True, dead=True), batch)
    skip = _actor("auto", fused=True, dead=True, dead_rows="skip")
    s_skip, g_skip, f_skip = _step(skip, batch)
    assert torch.allclose(g_skip, g_full, atol=1e-6, rtol=1e-4)
    assert s_skip["train/loss"] == pytest.approx(s_full["train/loss"], rel=1e-4, abs=1e-6)
    # a forward is a third of a forward and backward: the dead rows' share of tokens, a third
    assert f_skip < (1 - dead_share / 3 * 0.8) * f_full, (f_skip, f_full)
    assert s_skip["train/dead_rows"] == s_full["train/dead_rows"] == pytest.approx(dead_share)
    s_live, _, _ = _step(_actor("auto", fused=True, dead=True), make_batch(live, version=0))
    for key in ("train/entropy", "policy/ratio_mean", "mismatch/abs_logp_diff", "mismatch/kl"):
        assert s_skip[key] == pytest.approx(s_live[key], rel=1e-6, abs=1e-7), key
    assert s_skip["train/entropy"] != pytest.approx(s_full["train/entropy"], rel=1e-6)


def test_a_step_where_every_advantage_is_zero_still_steps_adamw_on_a_zero_gradient():
    """Skipping every backward must leave AdamW's update as on zero gradients: the momentum of the
    previous step still moves the weights, exactly as with the backward taken."""
    first, flat = _grpo_batch(4, 4, seed=2), _grpo_batch(4, 4, seed=3)
    flat.rewards.fill_(1.0)
    weights = []
    for dead in (False, True):
        actor = _actor("auto", fused=True, dead=False)
        actor.train(first)
        after_first = [p.detach().clone() for p in actor.model.parameters()]
        actor.skips_dead_backward = dead
        actor.train(flat)
        moved = [
            not torch.equal(a, p)
            for a, p in zip(after_first, actor.model.parameters(), strict=True)
        ]
        assert all(moved)
        weights.append(torch.cat([p.detach().reshape(-1) for p in actor.model.parameters()]))
    assert torch.equal(weights[0], weights[1])


def test_fused_step_with_a_nonfinite_trainer_logprob_drops_that_sample_like_two_passes():
    """MARK's input embedding made NaN: the sample holding it gets non-finite log-probs after it.
    The fused step starts over with a separate pass, which leaves that sample out and counts it;
    the sample, now without trained tokens, runs no backward, so its NaN cannot reach the gradient."""
    batch = _grpo_batch(4, 4, seed=1, marker=(5, 0))
    results = []
    for fused in (True, False):
        actor = _actor("auto", fused=fused, dead=True)
        embed = actor.model.get_input_embeddings()
        embed.register_forward_hook(
            lambda mod, args, out: out.masked_fill((args[0] == MARK)[..., None], float("nan"))
        )
        stats = actor.train(batch)
        grads = torch.cat([p.grad.reshape(-1) for p in actor.model.parameters()])
        assert stats["train/nonfinite_logprob_samples"] == 1.0
        assert stats["train/skipped_updates"] == 0.0 and torch.isfinite(grads).all()
        results.append((stats["train/loss"], grads))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    "name, expected",
    [("llama3", True), ("qwen3_moe", True), ("deepseek_v3", True), ("gemma2", False)],
)
def test_prefix_is_on_exactly_where_it_equals_padded_on_real_architectures(
    tmp_path, name, expected
):
    """Full-attention architectures (dense, MoE, MLA) take the prefix layout and give padded's
    log-probs and gradients on 3 prompts x 3 responses; sliding-window ones (Gemma 2) are refused."""
    from weir.tasks.tiny_archs import build_arch_model

    model = AutoModelForCausalLM.from_pretrained(build_arch_model(tmp_path / name, name)).eval()
    assert (choose_layout(model, "auto", shared_prompts=True) == "prefix") is expected
    if not expected:
        return
    rnd = random.Random(1)
    vocab = model.config.vocab_size
    seqs, lens = [], []
    for _ in range(3):
        prompt = [rnd.randrange(vocab) for _ in range(rnd.randint(3, 12))]
        for _ in range(3):
            n = rnd.randint(1, 15)
            seqs.append(prompt + [rnd.randrange(vocab) for _ in range(n)])
            lens.append(n)
    out = {}
    for layout in ("prefix", "padded"):
        model.zero_grad(set_to_none=True)
        res = response_logprobs(model, seqs, lens, layout=layout)
        res.logprobs.sum().backward()
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        out[layout] = (res.logprobs.detach(), torch.cat(grads))
    assert torch.allclose(out["prefix"][0], out["padded"][0], atol=1e-5)
    assert torch.allclose(out["prefix"][1], out["padded"][1], atol=1e-4, rtol=1e-4)


def test_one_token_answers_keep_their_prompt_group_whole():
    """One-token answers run no response pass (the prompt pass predicts them), so they cost the
    group nothing beyond its prompt: a 15-token prompt with two of them fits a 16-token budget
    in one micro-batch (hypothesis found them split, each row in a micro-batch of its own)."""
    seqs = [[1] * 15 + [2], [1] * 15 + [3]]
    assert prefix_micro_batches(seqs, [1, 1], 16) == [[0, 1]]
