"""A tiny vision-language model of a real architecture (Qwen2.5-VL), built locally with weir's
tokenizer and its own processor, saved as a standard HF directory that `AutoProcessor` and
`AutoModelForImageTextToText` load.

Qwen2.5-VL at toy size: a 2-block vision transformer (patch 8, 2x2 patch merging, window and full
attention blocks as in the real model) feeding a 2-layer Qwen2 decoder with multimodal rotary
positions (M-RoPE). The processor is Qwen2-VL's image processor (PIL backend: no torchvision), with
images of at most 48x48 pixels (6x6 patches, i.e. 9 image tokens), plus weir's byte-level tokenizer with the
four vision special tokens and a chat template that renders an image part as
``<|vision_start|><|image_pad|><|vision_end|>``.

`arch="qwen3_vl"` builds the same at Qwen3-VL's architecture instead: a Qwen3 decoder with
interleaved M-RoPE, a vision tower with learned position embeddings, and DeepStack (the first
vision block's features added to the decoder's first layer at the image tokens).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForImageTextToText,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen3VLConfig,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from weir.data.vision_processor import ImageQwen2_5_VLProcessor, ImageQwen3VLProcessor
from weir.tasks.tiny_model import SIZES, build_tokenizer

__all__ = [
    "ARCHS",
    "VISION_TOKENS",
    "VLM_CHAT_TEMPLATE",
    "build_tiny_vlm",
    "build_vlm_processor",
]

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# weir's `<|role|>content<|end|>` turns; a content list renders its image parts as Qwen's placeholder.
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "<|{{ message['role'] }}|>"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{%- endfor %}{%- endif %}<|end|>"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

PATCH = 8
MERGE = 2
ARCHS = ("qwen2_5_vl", "qwen3_vl")
IMAGE_SIDE = 48
"""The processor's largest side: a 48x48 image is 6x6 patches, 9 tokens after 2x2 merging (the
shapes task draws 32x32: 4x4 patches, 4 tokens)."""


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """weir's byte-level tokenizer plus the four vision special tokens and the VLM chat template."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = VLM_CHAT_TEMPLATE
    return tok


def build_vlm_processor(
    tokenizer: PreTrainedTokenizerFast | None = None,
    image_side: int = IMAGE_SIDE,
    arch: str = "qwen2_5_vl",
) -> ImageQwen2_5_VLProcessor | ImageQwen3VLProcessor:
    """Qwen2.5-VL's (or Qwen3-VL's) processor over weir's tokenizer; images are resized to at most
    `image_side` squared pixels (multiples of patch x merge = 16)."""
    tokenizer = tokenizer or build_vlm_tokenizer()
    unit = PATCH * MERGE
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": unit * unit, "longest_edge": image_side * image_side},
    )
    cls = ImageQwen3VLProcessor if arch == "qwen3_vl" else ImageQwen2_5_VLProcessor
    return cls(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=VLM_CHAT_TEMPLATE
    )


def tiny_vlm_config(
    tokenizer: PreTrainedTokenizerFast, size: str = "tiny", arch: str = "qwen2_5_vl"
) -> Qwen2_5_VLConfig | Qwen3VLConfig:
    """A Qwen2.5-VL (or Qwen3-VL) config: the text decoder of weir's tiny size `size`, a 2-block
    vision tower."""
    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {sorted(SIZES)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny VLM architecture {arch!r}; choose one of {list(ARCHS)}")
    dims = SIZES[size]
    hidden, heads = dims["hidden_size"], dims["num_attention_heads"]
    half = hidden // heads // 2  # M-RoPE splits the rotary half-dimensions into (t, h, w) sections
    section = [half - 2 * (half // 3), half // 3, half // 3]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    text = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
        **dims,
    )
    vision = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=hidden,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
    )
    tokens = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    if arch == "qwen3_vl":
        return Qwen3VLConfig(
            text_config=dict(
                text,
                head_dim=hidden // heads,
                rope_parameters={**rope, "mrope_interleaved": True},
            ),
            vision_config=dict(
                vision,
                num_position_embeddings=64,  # an 8x8 grid, interpolated to the image's patch grid
                deepstack_visual_indexes=[0],
            ),
            **tokens,
        )
    return Qwen2_5_VLConfig(
        text_config=dict(text, rope_parameters=rope),
        vision_config=dict(
            vision,
            window_size=PATCH * MERGE * 2,  # 2x2 merged tokens per window
            fullatt_block_indexes=[1],
        ),
        **tokens,
    )


def build_tiny_vlm(
    out_dir: str | Path, size: str = "tiny", seed: int = 0, arch: str = "qwen2_5_vl"
) -> Path:
    """Create a randomly initialised tiny Qwen2.5-VL (or Qwen3-VL, `arch="qwen3_vl"`) with weir's
    tokenizer and its processor as a standard HF directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor = build_vlm_processor(arch=arch)
    tokenizer = processor.tokenizer
    config = tiny_vlm_config(tokenizer, size, arch)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    processor.save_pretrained(out)
    # preprocessor_config.json too, as released checkpoints ship it: transformers before 5.20 reads
    # the image processor only from there, not from processor_config.json
    processor.image_processor.save_pretrained(out)
    return out
