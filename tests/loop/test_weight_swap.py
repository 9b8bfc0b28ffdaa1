"""A weight update while a response is in flight: continued with both versions, aborted and
regenerated, or finished under the old weights before the update."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from weir.buffer import StalenessBuffer
from weir.data.sources import PromptSource
from weir.engine import SamplingParams, TorchEngine
from weir.loop.async_loop import swap_weights
from weir.loop.producer import RolloutProducer
from weir.rollout.single_turn import RolloutContext, rollout


@pytest.mark.parametrize("policy", ["continue", "abort", "finish"])
def test_update_during_a_response(tiny_model_dir, policy):
    abort = policy == "abort"
    trainer_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = TorchEngine(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(),
        eos_token_ids=[1],
        pad_token_id=0,
        num_threads=1,
    )
    ctx = RolloutContext(
        engine=engine,
        tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens=True: ""),
        sampling=SamplingParams(n=2, max_new_tokens=300, stop_token_ids=[]),
        reward_fn=lambda sample, row: 0.0,
        encode=lambda row: [3, 22, 23, 1, 4],
    )
    buffer = StalenessBuffer(batch_groups=1, max_staleness=1)
    producer = RolloutProducer(
        ctx,
        rollout,
        PromptSource([{"prompt": "x"}] * 4, seed=0),
        buffer,
        lambda: engine.version,
        regenerate_aborted=abort,
    )
    producer.start()
    try:
        while engine.stats()["generated_tokens"] < 20:  # the first response is well under way
            time.sleep(0.005)
        with torch.no_grad():
            for p in trainer_model.parameters():
                p.add_(0.01)
        parts = SimpleNamespace(
            engine=engine, trainer=SimpleNamespace(weights=trainer_model.named_parameters)
        )
        metrics = swap_weights(parts, 1, policy)
        group = buffer.get_batch(0, timeout=60)[0]
    finally:
        producer.stop()
        engine.close()
    versions = {v for s in group.samples for v in s.versions}
    if abort:
        assert versions == {1}  # regenerated from scratch under the new weights
        assert producer.take_counts()["rollout/regenerated_groups"] >= 1
    elif policy == "finish":
        assert versions == {0}  # the update waited for the response to end
        assert metrics["time/drain"] > 0 and engine.version == 1
    else:
        assert versions == {0, 1}  # one response, two weight versions
        assert all(s.versions == sorted(s.versions) for s in group.samples)
