"""Tiny-model factory: a byte-level tokenizer weir ships and small HF causal-LM configs.

No pretrained model can be downloaded on the machines weir targets first, so tests and demos build
their own: a standard Hugging Face directory (config, safetensors weights, tokenizer with a chat
template) that the same `from_pretrained` code path loads as any real model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]

# `<|role|>content<|end|>` per message; the assistant turn opens with `<|assistant|>` and the model
# closes it with `<|end|>`, which is therefore the EOS token. Tools (`tools=`, OpenAI function schemas)
# are listed compactly in the system turn as `name(arg, ...): description`, one per line. An
# assistant message's `tool_calls` (OpenAI `{"function": {...}}` or plain `{"name", "arguments"}`)
# follow its content in the Hermes format `<tool_call>\n{json}\n</tool_call>`, exactly as
# `weir.rollout.tool_calls.render_tool_calls` writes them; a tool result is `<|tool|>...<|end|>`.
CHAT_TEMPLATE = (
    "{%- set sys = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    "{%- if sys is not none or tools %}<|system|>"
    "{%- if sys is not none %}{{ sys }}{% endif %}"
    "{%- if tools %}{% if sys %}{{ '\\n' }}{% endif %}tools:"
    "{%- for t in tools %}{% set f = t['function'] if t['function'] is defined else t %}"
    "{{ '\\n' }}{{ f['name'] }}({{ (f['parameters']['properties'] | list if f['parameters'] is defined"
    " and f['parameters']['properties'] is defined else []) | join(', ') }})"
    "{%- if f['description'] %}: {{ f['description'] }}{% endif %}"
    "{%- endfor %}{% endif %}<|end|>"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "<|{{ message['role'] }}|>"
    "{%- if message['content'] is not none %}{{ message['content'] }}{% endif %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined"
    " and message['tool_calls'] %}"
    "{%- for tc in message['tool_calls'] %}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc %}"
    "{%- if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": {{ f[\'name\'] | tojson }}, "arguments": '
    "{%- if f['arguments'] is string %} {{ f['arguments'] }}"
    "{%- else %} {{ f['arguments'] | tojson }}{% endif %}}\n</tool_call>"
    "{%- endfor %}{% endif %}<|end|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

SIZES: dict[str, dict[str, int]] = {
    # name: hidden, layers, heads, kv heads, mlp
    "nano": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
    ),
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=768,
    ),
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per UTF-8 byte (no merges), so it encodes any text.

    One token per character keeps digit arithmetic learnable by a model with a few layers.
    """
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        unk_token=None,
        bos_token=None,
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(
    tokenizer: PreTrainedTokenizerFast,
    size: str = "tiny",
    arch: str = "qwen3",
    max_position_embeddings: int = 512,
) -> Qwen3Config | LlamaConfig:
    """A small Qwen3 or Llama config sized for CPU training in minutes."""
    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {sorted(SIZES)}")
    dims = SIZES[size]
    common = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        head_dim=dims["hidden_size"] // dims["num_attention_heads"],
        rope_theta=10000.0,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **dims,
    )
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny model arch {arch!r}; choose 'qwen3' or 'llama'")


def build_tiny_model(
    out_dir: str | Path,
    size: str = "tiny",
    arch: str = "qwen3",
    seed: int = 0,
    max_position_embeddings: int = 512,
) -> Path:
    """Create a randomly initialised tiny model with weir's tokenizer as a standard HF directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = tiny_config(
        tokenizer, size=size, arch=arch, max_position_embeddings=max_position_embeddings
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
