"""Fixtures for the server tests: the tiny model on a TorchEngine, a scripted engine whose outputs a
test chooses, and servers bound to free local ports."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from weir.engine.base import Completion, SamplingParams
from weir.engine.torch_engine import TorchEngine
from weir.serve import Server


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    eng = TorchEngine(
        model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, seed=3
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with Server(engine, tokenizer, model_name="tiny") as srv:
        yield srv


class ScriptedEngine:
    """An `Engine` that answers with the texts a test queued, each followed by EOS, with made-up
    but distinct log-probs and versions; it keeps every prompt it was given."""

    def __init__(self, tokenizer, version: int = 7):
        self.tokenizer = tokenizer
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.version = version
        self.replies: list[str] = []
        self.prompts: list[list[int]] = []
        self.max_seq_len = 512

    async def generate(self, prompt_ids, params: SamplingParams) -> list[Completion]:
        self.prompts.append(list(prompt_ids))
        text = self.replies.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + self.eos_token_ids
        ids = ids[: params.max_new_tokens]
        lps = [-0.01 * (len(self.prompts) * 100 + k + 1) for k in range(len(ids))]
        finish = "stop" if ids and ids[-1] in self.eos_token_ids else "length"
        await asyncio.sleep(0)
        return [Completion(ids, lps, [self.version] * len(ids), finish) for _ in range(params.n)]

    async def update_weights(self, named_tensors, version):
        self.version = version

    async def pause(self):
        pass

    async def resume(self):
        pass

    async def abort(self):
        pass


@pytest.fixture
def scripted(tokenizer):
    eng = ScriptedEngine(tokenizer)
    with Server(eng, tokenizer) as srv:
        yield eng, srv
