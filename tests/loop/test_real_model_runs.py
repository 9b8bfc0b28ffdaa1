"""A real model's chat template and tokenizer through SFT, RL, export and reload: SmolLM2-135M-Instruct
(the `smollm2_dir` fixture) warm-started by `weir sft` on chat rows with a system message, trained
one GRPO step by `weir train`, exported by `weir export` and read back by transformers; every
directory on the way renders a chat to the same ids as the original and ends a turn the same way."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import weir
from weir.train.export import export_model

CHAT = [
    {"role": "system", "content": "Answer with the number only."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "And 7 + 5?"},
]


def _common(tmp_path, name: str) -> dict:
    return {
        "run": {"name": name, "dir": str(tmp_path / name), "seed": 0, "resume": "never"},
        "model": {"threads": 1},
        "telemetry": {"console": False, "trace": False},
    }


@pytest.mark.slow
def test_chat_template_and_tokenizer_survive_sft_rl_export_reload(smollm2_dir, tmp_path):
    rows = [
        {"messages": CHAT[:2], "response": "42", "answer": "42"},
        {
            "messages": [{"role": "user", "content": "What is 3 + 4?"}],
            "response": "7",
            "answer": "7",
        },
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft_model = weir.sft(
        {
            **_common(tmp_path, "sft"),
            "model": {"path": str(smollm2_dir), "threads": 1},
            "data": {"task": None, "source": str(data), "eval_source": str(data)},
            "sft": {"data": str(data), "epochs": 1, "batch_size": 2, "lr": 1e-5, "warmup_steps": 0},
        }
    )
    result = weir.run(
        {
            **_common(tmp_path, "rl"),
            "model": {"path": str(sft_model), "threads": 1},
            "data": {"task": None, "source": str(data), "eval_source": str(data), "eval_size": 2},
            "reward": {"function": "numeric"},
            "rollout": {"n": 2, "batch_prompts": 2, "max_new_tokens": 6},
            "run": {**_common(tmp_path, "rl")["run"], "steps": 1, "eval_every": 0},
            "train": {"lr": 1e-5},
            "telemetry": {"console": False, "trace": False, "dump_rollouts": True},
        }
    )
    exported = export_model(result.dir, tmp_path / "exported")

    original = AutoTokenizer.from_pretrained(smollm2_dir)
    want_text = original.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    want_ids = original(want_text, add_special_tokens=False)["input_ids"]
    for where in (sft_model, result.model_dir, exported):
        tok = AutoTokenizer.from_pretrained(where)
        assert tok.chat_template == original.chat_template, where
        assert tok.get_vocab() == original.get_vocab(), where
        assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>",) * 2 + (
            "<|im_start|>",
        )
        text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert text == want_text and tok(text, add_special_tokens=False)["input_ids"] == want_ids
        assert GenerationConfig.from_pretrained(where).eos_token_id == original.eos_token_id

    # the RL step's prompts were the model's own rendering of each row's chat
    (dump,) = (result.dir / "rollouts").glob("step_*1.jsonl")
    dumped = [json.loads(line) for line in dump.open()]
    rendered = {
        tuple(original(text, add_special_tokens=False)["input_ids"])
        for text in (
            original.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
            for r in rows
        )
    }
    assert len(dumped) == 4 and {tuple(d["prompt_ids"]) for d in dumped} == rendered

    # the export is the trained model, which SFT and RL moved away from the original
    ids = torch.tensor([want_ids])
    with torch.no_grad():
        trained = AutoModelForCausalLM.from_pretrained(result.model_dir).eval()(ids).logits
        reloaded = AutoModelForCausalLM.from_pretrained(exported).eval()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()(ids).logits
    assert torch.equal(trained, reloaded)
    assert (trained - base).abs().max().item() > 1e-4
