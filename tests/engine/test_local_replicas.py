"""Built-in engines in several child processes behind one engine (`weir.engine.local_replicas`):
prompts spread over the replicas, samples that depend on the request's seed and not on the replica,
weight updates that reach every replica, control and checkpoint state, and a refused config."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random

import pytest
import torch
from engine_helpers import EOS, PAD, assert_parity, make_prompts, perturbed
from pydantic import ValidationError

from weir.config import load_config
from weir.engine import TorchEngine
from weir.engine.base import SamplingParams
from weir.engine.local_replicas import LocalReplicas
from weir.engine.process_engine import ProcessEngine

PARAMS = SamplingParams(n=3, temperature=1.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def replicas(base_model):
    engines = [  # this process's thread count: bit-equal to an engine here needs the same one
        ProcessEngine(
            copy.deepcopy(base_model),
            eos_token_ids=[EOS],
            pad_token_id=PAD,
            seed=7,
            num_threads=torch.get_num_threads(),
        )
        for _ in range(2)
    ]
    group = LocalReplicas(engines, seed=3)
    yield group
    group.close()


def _served(group: LocalReplicas) -> list[float]:
    return [r.stats()["requests"] for r in group.replicas]


def test_prompts_alternate_and_each_sample_is_its_seeds_not_its_replicas(base_model, replicas):
    """Paused, the replicas admit nothing, so the four prompts alternate between them (the least
    loaded, the lower index on a tie) and each replica then admits its two together: a single engine
    given the same two prompts with the seeds the group drew must sample the same bits."""
    prompts = make_prompts(4, 3, 16, seed=1)
    before = _served(replicas)
    seeds_from = random.Random()
    seeds_from.setstate(replicas.state_dict()["rng"])
    seeds = [seeds_from.getrandbits(64) for _ in prompts]
    replicas.pause_sync()
    futures = replicas.submit_many(prompts, PARAMS)
    assert replicas.outstanding == [2, 2]
    replicas.resume_sync()
    got = [f.result() for f in futures]
    assert replicas.outstanding == [0, 0]
    assert [a - b for a, b in zip(_served(replicas), before, strict=True)] == [2, 2]
    with TorchEngine(copy.deepcopy(base_model), eos_token_ids=[EOS], pad_token_id=PAD) as ref:
        for ks in ([0, 2], [1, 3]):  # replica 0's prompts, replica 1's
            want = ref.generate_many(
                [prompts[k] for k in ks], [dataclasses.replace(PARAMS, seed=seeds[k]) for k in ks]
            )
            for k, w in zip(ks, want, strict=True):
                assert [c.token_ids for c in got[k]] == [c.token_ids for c in w]
                assert [c.logprobs for c in got[k]] == [c.logprobs for c in w]


def test_the_least_loaded_replica_takes_the_next_prompt(replicas):
    """Replica 0 is held (paused), so its prompt stays outstanding: once replica 1 has finished
    its own, the next prompt goes to replica 1 again (round robin would send it to 0)."""
    p, q, r = make_prompts(3, 3, 8, seed=4)
    before = _served(replicas)
    replicas.replicas[0].pause_sync()
    try:
        held = replicas.submit(p, PARAMS)
        replicas.submit(q, PARAMS).result()
        assert replicas.outstanding == [1, 0]
        replicas.submit(r, PARAMS).result()
        assert not held.done()
    finally:
        replicas.replicas[0].resume_sync()
    held.result()
    assert [a - b for a, b in zip(_served(replicas), before, strict=True)] == [1, 2]


def test_weight_updates_reach_every_replica(base_model, replicas):
    prompts = make_prompts(4, 4, 10, seed=2)
    new = perturbed(base_model, seed=11)
    asyncio.run(replicas.update_weights(new.items(), 5))
    assert replicas.version == 5 and [r.version for r in replicas.replicas] == [5, 5]
    reference = copy.deepcopy(base_model)
    reference.load_state_dict(new, strict=False)
    before = _served(replicas)
    for prompt, completions in zip(prompts, replicas.generate_many(prompts, PARAMS), strict=True):
        for c in completions:
            assert set(c.versions) == {5}
            assert_parity(reference, prompt, c)
    assert min(a - b for a, b in zip(_served(replicas), before, strict=True)) >= 1


def test_control_stats_and_checkpoint_state(replicas):
    prompts = make_prompts(4, 3, 8, seed=6)
    replicas.pause_sync()
    futures = replicas.submit_many(prompts, PARAMS)
    assert not any(f.done() for f in futures)  # paused: nothing is admitted
    replicas.resume_sync()
    for f in futures:  # both replicas' prompts: the resume reached both
        f.result()
    assert replicas.drain_sync(60)  # nothing runs anywhere; new requests wait for a resume
    replicas.resume_sync()
    stats = replicas.stats()
    each = [r.stats() for r in replicas.replicas]
    assert stats["replicas"] == 2
    assert stats["requests"] == sum(s["requests"] for s in each)
    assert stats["generated_tokens"] == sum(s["generated_tokens"] for s in each)
    # a resumed run samples what the uninterrupted one would have
    state = replicas.state_dict()
    first = replicas.generate_many(prompts, PARAMS)
    replicas.load_state_dict(state)
    again = replicas.generate_many(prompts, PARAMS)
    assert [[c.token_ids for c in cs] for cs in again] == [
        [c.token_ids for c in cs] for cs in first
    ]
    with pytest.raises(
        ValueError,
        match="state of 1 engine replicas and this run has 2: resume with engine.replicas=1",
    ):
        replicas.load_state_dict({**state, "replicas": state["replicas"][:1]})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["engine.replicas=2"], "set engine.process=true"),
        (
            ["engine.replicas=2", "engine.process=true", "run.deterministic=true"],
            "run.deterministic needs engine.replicas=1",
        ),
    ],
)
def test_configs_that_cannot_run_are_refused(overrides, message):
    with pytest.raises((ValidationError, ValueError), match=message):
        load_config(None, overrides)


def test_engine_processes_share_the_runs_threads(engine_model_dir, base_model):
    """A sync run on 2 torch threads with two engine processes: each decodes on one thread (2
    threads on 2 cores, where each child taking the run's 2 made 4)."""
    from transformers import AutoTokenizer

    from weir.loop.components import make_engine

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = load_config(None, ["engine.process=true", "engine.replicas=2"])
        engine = make_engine(
            cfg, copy.deepcopy(base_model), AutoTokenizer.from_pretrained(engine_model_dir)
        )
    finally:
        torch.set_num_threads(before)
    try:
        assert [e.stats()["threads"] for e in engine.replicas] == [1.0, 1.0]
        assert engine.stats()["threads"] == 2.0  # summed over the replicas
    finally:
        engine.close()
