"""`train.packing=auto` picks, for each step, the cheapest exact layout by a cost model; on the
length mixes of RL batches (the trainer-step audit's table) it takes `prefix` only where responses
are equal, and `varlen` (or `padded` without it) where they spread."""

from __future__ import annotations

import copy
import functools
import logging
import math
import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from weir.config import build_config
from weir.data.sample import Group, Sample
from weir.train import layout_cost
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.layout_cost import CostModel, LayoutChoice, cheapest_layout
from weir.train.layout_cost import layout_cost as cost

# Qwen2.5-0.5B and -1.5B: vocabulary, hidden, heads, head dim, layers, parameters less embeddings
SHAPES = {
    "0.5b": (151936, 896, 14, 64, 24, 494_032_768 - 151936 * 896),
    "1.5b": (151936, 1536, 12, 128, 28, 1_543_714_304 - 2 * 151936 * 1536),
}


def _gpu_prices(shape: str, **override) -> CostModel:
    v, d, h, hd, layers, n = SHAPES[shape]
    base = CostModel.for_shape(
        vocab=v,
        hidden=d,
        heads=h,
        head_dim=hd,
        layers=layers,
        decoder_params=n,
        gpu=True,
        varlen_flash=True,
    )
    return CostModel(**{**base.__dict__, **override})


def _lognormal(mean: float, lo: int, hi: int):
    """Lengths of median about 0.73 x `mean` (sigma 0.8), clipped to [lo, hi]."""
    mu = math.log(mean) - 0.32
    return lambda rnd: int(min(hi, max(lo, rnd.lognormvariate(mu, 0.8))))


MIXES = {
    "fixed 128 + 128": (lambda r: 128, lambda r: 128),
    "128 + lognormal(300)": (lambda r: 128, _lognormal(300, 16, 1024)),
    "U[50,300] + lognormal(300)": (lambda r: r.randint(50, 300), _lognormal(300, 16, 1024)),
    "U[50,300] + lognormal(1500)": (lambda r: r.randint(50, 300), _lognormal(1500, 16, 4096)),
}


def _batch(mix: str, prompts: int = 32, n: int = 8, seed: int = 0):
    prompt_len, response_len = MIXES[mix]
    rnd = random.Random(seed)
    seqs, lens = [], []
    for _ in range(prompts):
        prompt = [rnd.randrange(1000) for _ in range(prompt_len(rnd))]
        for _ in range(n):
            r = response_len(rnd)
            seqs.append(prompt + [rnd.randrange(1000) for _ in range(r)])
            lens.append(r)
    return seqs, lens


def test_the_counts_of_one_micro_batch_are_the_closed_forms():
    """32 prompts x 8 answers, P = R = 128, all in one micro-batch: varlen runs 256 x 256 tokens
    and 256 x 128 head rows; padded the same tokens and 256 x 129 rows; a one-pass prefix
    32 x 128 + 256 x 127 tokens (0.56x) in two forwards, with 256 + 256 x 127 rows."""
    seqs, lens = _batch("fixed 128 + 128")
    prices = _gpu_prices("0.5b")
    v = cost("varlen", seqs, lens, 10**7, prices)
    p = cost("padded", seqs, lens, 10**7, prices)
    x = cost("prefix", seqs, lens, 10**7, prices, one_pass=True)
    assert (v.tokens, v.head_rows, v.forwards, v.pairs) == (65536, 32768, 1, 256 * 256 * 257 / 2)
    assert (p.tokens, p.head_rows, p.forwards, p.masked_pairs) == (65536, 256 * 129, 1, 0)
    assert (x.tokens, x.head_rows, x.forwards) == (32 * 128 + 256 * 127, 256 * 128, 2)
    assert x.masked_pairs == 256 * (127 * 128 + 127 * 128 / 2)  # the prompts: one length, no mask
    assert x.pairs == 32 * 128 * 129 / 2


@pytest.mark.parametrize("shape", ["0.5b", "1.5b"])
@pytest.mark.parametrize("budget", [8192, 32768])
@pytest.mark.parametrize("mix", list(MIXES))
def test_auto_takes_prefix_only_for_equal_responses_on_a_gpu(shape, budget, mix):
    """With equal responses a one-pass prefix runs 0.56x the tokens for the same head rows: it
    wins at any price of its one extra forward per micro-batch below the tokens it saves. With
    spread responses it pads each to the micro-batch's longest: more tokens, more head rows and
    more forwards than varlen, so it loses at any prices; padded loses to varlen by its padding
    and its (r + 1)-column head."""
    seqs, lens = _batch(mix)
    for softmax, pass_tokens in ((1.0, 256), (4.0, 1024), (8.0, 4096)):  # fused .. unfused heads
        prices = _gpu_prices(shape, pass_tokens=pass_tokens)
        v, d, *_ = SHAPES[shape]
        n_dec = SHAPES[shape][-1]
        prices = CostModel(**{**prices.__dict__, "head_row": v * d * (1 + softmax) / n_dec})
        c = {
            name: cost(name, seqs, lens, budget, prices, one_pass=True)
            for name in ("prefix", "varlen", "padded")
        }
        options = dict(one_pass=True)
        chosen, _ = cheapest_layout(
            ["prefix", "varlen", "padded"], seqs, lens, budget, prices, **options
        )
        without, _ = cheapest_layout(["prefix", "padded"], seqs, lens, budget, prices, **options)
        if mix.startswith("fixed"):
            assert c["prefix"].tokens / c["varlen"].tokens == pytest.approx(0.56, abs=0.01)
            assert (chosen, without) == ("prefix", "prefix")
        else:
            assert c["prefix"].tokens > 1.05 * c["varlen"].tokens
            assert c["prefix"].head_rows > 1.1 * c["varlen"].head_rows
            assert c["prefix"].forwards > c["varlen"].forwards
            assert c["padded"].tokens >= c["varlen"].tokens
            assert c["padded"].head_rows > c["varlen"].head_rows
            assert (chosen, without) == ("varlen", "padded")


def test_the_gpu_prices_agree_with_the_h200_run():
    """benchmarks/gpu_trainer.py's 0.5B batch (16 prompts of U[64, 192] tokens, 8 responses each of
    lognormal(median 256, sigma 0.7) tokens in [16, 1024], seed 0; micro-batches of 16,384 tokens)
    on an H200 (docs/gpu.md): padded took 0.936 s, varlen 0.702-0.711 s, 1.32-1.33x; `auto` ran
    varlen. The model's ratio is within that run's noise of it, and its order is the same."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(64, 193, (16,), generator=g).tolist()
    z = torch.randn(128, generator=g, dtype=torch.float64)
    lens = torch.exp(math.log(256) + 0.7 * z).round().clamp(16, 1024).long().tolist()
    seqs = [[1 + i // 8] * prompts[i // 8] + [0] * r for i, r in enumerate(lens)]
    assert sum(len(s) for s in seqs) == 58688  # the run's batch
    prices = _gpu_prices("0.5b")
    c = {
        x: cost(x, seqs, lens, 16384, prices, one_pass=True) for x in ("prefix", "varlen", "padded")
    }
    assert 1.24 < c["padded"].total / c["varlen"].total < 1.42
    assert c["varlen"].total < c["padded"].total < c["prefix"].total


def test_one_pass_prefix_does_the_audits_extra_work_on_lognormal_responses():
    """The audit's figure: with 128-token prompts and lognormal(300) responses, the one-pass
    prefix runs 1.5-1.7x the tokens of an unpadded layout and about twice its head rows."""
    seqs, lens = _batch("128 + lognormal(300)")
    prices = _gpu_prices("0.5b")
    for budget in (8192, 32768):
        x = cost("prefix", seqs, lens, budget, prices, one_pass=True)
        v = cost("varlen", seqs, lens, budget, prices)
        assert 1.45 < x.tokens / v.tokens < 1.95
        assert 1.8 < x.head_rows / v.head_rows < 2.8


@functools.cache
def _tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return AutoModelForCausalLM.from_config(config)


def test_on_a_cpu_short_answers_to_shared_prompts_take_prefix():
    """The demo's shape (16 prompts of 8 tokens, 8 answers of 2-5): prefix's passes run the
    prompt once and the answers by length, about a third of the tokens of either other layout."""
    rnd = random.Random(0)
    seqs, lens = [], []
    for _ in range(16):
        prompt = [rnd.randrange(97) for _ in range(8)]
        for _ in range(8):
            n = rnd.randint(2, 5)
            seqs.append(prompt + [rnd.randrange(97) for _ in range(n)])
            lens.append(n)
    prices = CostModel.for_model(_tiny(0), torch.device("cpu"), varlen_flash=False)
    x = cost("prefix", seqs, lens, 8192, prices)
    v = cost("varlen", seqs, lens, 8192, prices)
    assert x.tokens < 0.45 * v.tokens
    assert cheapest_layout(["prefix", "varlen", "padded"], seqs, lens, 8192, prices)[0] == "prefix"


def test_the_choice_is_logged_when_it_changes(caplog):
    prices = _gpu_prices("0.5b")
    choice = LayoutChoice(["prefix", "varlen", "padded"], prices, one_pass=True)
    equal, spread = _batch("fixed 128 + 128", 4), _batch("128 + lognormal(300)", 4)
    with caplog.at_level(logging.INFO, logger=layout_cost.__name__):
        assert choice.pick(*equal, 8192) == "prefix"
        assert choice.pick(*equal, 8192) == "prefix"
        assert choice.pick(*spread, 8192) == "varlen"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("train.packing=auto: prefix micro-batches from this step")
    assert re.search(r"others: varlen 1\.\d\dx, padded 1\.\d\dx\)$", lines[0])
    assert lines[1].startswith("train.packing=auto: varlen micro-batches from this step")
    assert LayoutChoice(["padded"], prices, one_pass=True).pick(*spread, 8192) == "padded"


def _groups(prompt: int, responses: list[list[int]], seed: int = 0) -> list[Group]:
    rnd = random.Random(seed)
    groups = []
    for g, lengths in enumerate(responses):
        ids = [rnd.randrange(1, 96) for _ in range(prompt)]
        samples = [
            Sample(
                prompt_ids=ids,
                response_ids=[rnd.randrange(1, 96) for _ in range(n)],
                rollout_logprobs=[-4.0] * n,
                versions=[0] * n,
                reward=float(i % 2),
                group_id=g,
                index=i,
            )
            for i, n in enumerate(lengths)
        ]
        groups.append(Group(samples=samples, group_id=g))
    return groups


def test_an_actor_step_in_varlen_trains_what_the_padded_step_trains():
    """`train.packing=varlen` through the whole step (fused old log-probs, dead rows skipped):
    the padded step's gradient and metrics, and `auto` lists varlen among its candidates."""
    batch = make_batch(_groups(6, [[3, 9, 1, 14], [7, 7, 2, 11], [5, 12, 4, 6]]), version=0)
    results = {}
    for packing in ("varlen", "padded"):
        model = copy.deepcopy(_tiny(1))
        cfg = build_config({}, [f"train.packing={packing}", "train.lr=1e-3"])
        actor = Actor(model, ActorSettings.from_config(cfg))
        assert actor.layouts.candidates == [packing]
        stats = actor.train(batch)
        grads = torch.cat([p.grad.reshape(-1) for p in actor.model.parameters()])
        results[packing] = stats, grads
    (sv, gv), (sp, gp) = results["varlen"], results["padded"]
    assert torch.allclose(gv, gp, atol=1e-6, rtol=1e-4)
    for key in ("train/loss", "train/entropy", "policy/pg_loss", "mismatch/abs_logp_diff"):
        assert sv[key] == pytest.approx(sp[key], rel=1e-4, abs=1e-6), key
    auto = Actor(model, ActorSettings.from_config(build_config({}, ["train.packing=auto"])))
    assert auto.layouts.candidates == ["prefix", "varlen", "padded"]


def _shared(prompt: int, response: int, n: int, prompts: int = 16, seed: int = 0):
    rnd = random.Random(seed)
    seqs, lens = [], []
    for _ in range(prompts):
        p = [rnd.randrange(1000) for _ in range(prompt)]
        for _ in range(n):
            seqs.append(p + [rnd.randrange(1000) for _ in range(response)])
            lens.append(response)
    return seqs, lens


def test_with_compiled_layers_prefix_pays_for_running_uncompiled():
    """`train.fuse=compile` runs `prefix`'s forwards (they carry a KV cache) uncompiled, and a
    whole step uncompiled costs `UNCOMPILED_STEP` = 1.35x (the smaller gain an H200 measured).
    Equal 128-token answers to 128-token prompts: prefix models at 0.80x varlen's cost, 1.08x
    once uncompiled, so varlen runs; 1,024-token prompts shared by 8 answers of 128: 0.37x, 0.50x
    uncompiled, prefix still runs. Only prefix's price moves."""
    assert layout_cost.UNCOMPILED_STEP == 1.35
    prices = _gpu_prices("0.5b")
    compiled = CostModel(**{**prices.__dict__, "prefix_factor": layout_cost.UNCOMPILED_STEP})
    every = ["prefix", "varlen", "padded"]
    for (seqs, lens), plain, fused in (
        (_shared(128, 128, 8, prompts=32), "prefix", "varlen"),
        (_shared(1024, 128, 8), "prefix", "prefix"),
    ):
        for layout in every:
            a = cost(layout, seqs, lens, 16384, prices, one_pass=True).total
            b = cost(layout, seqs, lens, 16384, compiled, one_pass=True).total
            assert b == pytest.approx(a * (1.35 if layout == "prefix" else 1.0))
        assert cheapest_layout(every, seqs, lens, 16384, prices, one_pass=True)[0] == plain
        assert cheapest_layout(every, seqs, lens, 16384, compiled, one_pass=True)[0] == fused


def test_an_actor_prices_prefix_by_its_fusion(monkeypatch):
    """The actor chooses its candidates before it fuses (the probes run uncompiled), then prices
    them by the route taken: `compile` makes prefix dearer, `off` leaves it."""
    from weir.algo.logprob_triton import c_compiler
    from weir.train import fuse

    if c_compiler() is None:
        pytest.skip("no C compiler here: the compile route is refused")
    monkeypatch.setattr(fuse, "COMPILE_OPTIONS", {"dynamic": True, "backend": "eager"})
    factors = {}
    for route in ("off", "compile"):
        cfg = build_config({}, [f"train.fuse={route}", "rollout.batch_prompts=2", "rollout.n=4"])
        actor = Actor(_tiny(0), ActorSettings.from_config(cfg))
        assert actor.fusion.route == route
        factors[route] = actor.layouts.prices.prefix_factor
    assert factors == {"off": 1.0, "compile": layout_cost.UNCOMPILED_STEP}
