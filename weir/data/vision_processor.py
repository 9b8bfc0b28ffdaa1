"""Loading a vision-language model's processor, and Qwen2.5-VL's and Qwen3-VL's processors for
images only.

`load_processor` is ``AutoProcessor.from_pretrained`` on the model directory. Qwen's own processor
class also builds a video processor, which needs torchvision; PyPI's torchvision wheels are built
against CUDA torch and do not load next to the CPU torch weir installs on CPU machines. So weir
registers `ImageQwen2_5_VLProcessor` and `ImageQwen3VLProcessor` (the same image handling, no
video) with `AutoProcessor`, and directories saved with them (weir's tiny VLMs) load through the
standard path. transformers before 5.20 looks a saved ``processor_class`` up by name among its own
classes only and, not finding these, returns the bare tokenizer; `load_processor` loads a
directory that names one of them with that class directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import (
    AutoProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen3VLConfig,
    Qwen3VLProcessor,
)
from transformers.processing_utils import ProcessorMixin

__all__ = ["ImageQwen2_5_VLProcessor", "ImageQwen3VLProcessor", "load_processor"]


class ImageQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor for images only: the same placeholder expansion (one
    ``<|image_pad|>`` per merged patch) and the same pixels, without the video processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class ImageQwen3VLProcessor(Qwen3VLProcessor):
    """Qwen3-VL's processor for images only: an image expands as in Qwen2.5-VL (one
    ``<|image_pad|>`` per merged patch); videos, with their timestamps, are not supported."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.vision_start_token = "<|vision_start|>"
        self.vision_end_token = "<|vision_end|>"
        for name in ("image", "video", "vision_start", "vision_end"):
            token = getattr(self, f"{name}_token")
            setattr(self, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


AutoProcessor.register(Qwen2_5_VLConfig, ImageQwen2_5_VLProcessor, exist_ok=True)
AutoProcessor.register(Qwen3VLConfig, ImageQwen3VLProcessor, exist_ok=True)


def load_processor(path: str | Path) -> Any:
    """The processor of the vision-language model at `path` (its tokenizer is ``.tokenizer``).

    Raises ValueError, naming the fix, when the directory has no image processor."""
    own = {c.__name__: c for c in (ImageQwen2_5_VLProcessor, ImageQwen3VLProcessor)}
    loader = own.get(_saved_processor_class(Path(path)) or "", AutoProcessor)
    try:
        processor = loader.from_pretrained(str(path))
    except (OSError, ValueError, ImportError) as err:
        raise ValueError(
            f"cannot load the processor of the vision-language model at {path}: {err}. The "
            "directory needs preprocessor_config.json (the image processor) beside the tokenizer"
        ) from None
    if getattr(processor, "image_processor", None) is None:
        raise ValueError(
            f"the vision-language model at {path} has no image processor "
            "(preprocessor_config.json); copy it from the model's original directory"
        )
    return processor


def _saved_processor_class(path: Path) -> str | None:
    """The ``processor_class`` a saved processor names (processor_config.json, else
    tokenizer_config.json), or None."""
    for name in ("processor_config.json", "tokenizer_config.json"):
        try:
            found = json.loads((path / name).read_text()).get("processor_class")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, str):
            return found
    return None
