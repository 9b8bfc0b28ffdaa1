"""Prompts with images: the pixel inputs a prompt carries, where its images come from, and how a data
row becomes prompt ids plus pixels through the model's own processor.

A row gives its images either beside a text prompt (``{"prompt": "...", "images": [ref, ...]}``, the
images placed before the text in the first user turn) or as content parts of a chat, in the
OpenAI form (``{"type": "image_url", "image_url": {"url": ...}}``) or the Hugging Face form
(``{"type": "image", "image": ref}`` / ``"path"`` / ``"url"``). An image reference is a file path,
a ``data:image/...;base64,`` URL, raw bytes, a PIL image, or a ``{"bytes": ..., "path": ...}`` dict
(the HF `datasets` Image feature). Remote ``http(s)`` URLs are refused unless the caller allows them.

The processor is applied ONCE, when the prompt is encoded: the ids (with the image placeholder
tokens expanded) and the pixel tensors it returns travel together in the `Sample` to the engine and
to the trainer, so both see exactly the same ids and the same pixels.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weir.data.prompts import BadRow, PromptTooLong, prompt_messages

if TYPE_CHECKING:
    import torch

__all__ = [
    "VisionInputs",
    "attach_processor",
    "encode_vision_prompt",
    "process_vision_text",
    "image_data_url",
    "load_image",
    "processor_of",
    "vision_messages",
]

# Processor outputs that are token-aligned (recomputed from the ids), not pixel inputs.
_TOKEN_KEYS = {"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"}


@dataclass
class VisionInputs:
    """The pixel inputs of one prompt, as the model's processor produced them.

    tensors: the processor's image outputs (for Qwen2.5-VL ``pixel_values`` [patches, C*T*P*P] and
        ``image_grid_thw`` [images, 3]); several prompts' inputs are concatenated along dim 0.
    images: one reference per image (the path or URL it was given as, else a PNG data URL), for the
        report and the rollout dumps; the tensors, not these, are what the model sees.
    """

    tensors: dict[str, torch.Tensor]
    images: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # torch is imported here, not at the top: a Sample without images never needs it (a
        # reward worker unpickling text samples starts without it)
        import torch

        for k, v in self.tensors.items():
            if not isinstance(v, torch.Tensor):
                self.tensors[k] = torch.as_tensor(v)

    @property
    def num_images(self) -> int:
        return len(self.images)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The tensors on `device`; floating ones cast to `dtype` when given."""
        out = {}
        for k, v in self.tensors.items():
            v = v.to(device)
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
            out[k] = v
        return out

    @staticmethod
    def concat(
        items: Sequence[VisionInputs | None], device: torch.device | str
    ) -> dict[str, torch.Tensor]:
        """The forward kwargs of several prompts at once: each tensor concatenated along dim 0, in
        the order of `items` (the order their image tokens appear in a batch's rows)."""
        import torch

        present = [x for x in items if x is not None]
        if not present:
            return {}
        keys = list(present[0].tensors)
        for x in present:
            if list(x.tensors) != keys:
                raise ValueError(
                    f"prompts with different pixel inputs in one batch: {keys} vs {list(x.tensors)}"
                )
        return {k: torch.cat([x.tensors[k] for x in present]).to(device) for k in keys}

    def equal(self, other: VisionInputs | None) -> bool:
        """Same tensors, bit for bit."""
        import torch

        if other is None or list(self.tensors) != list(other.tensors):
            return False
        return all(torch.equal(self.tensors[k], other.tensors[k]) for k in self.tensors)

    @classmethod
    def coerce(cls, value: Any) -> VisionInputs | None:
        """A `VisionInputs` from itself or from its `dataclasses.asdict` form (a restored buffer)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping) and "tensors" in value:
            return cls(dict(value["tensors"]), list(value.get("images", [])))
        raise TypeError(f"Sample.vision must be VisionInputs or None, got {type(value).__name__}")


# -- processors -------------------------------------------------------------------------------------


def attach_processor(tokenizer: Any, processor: Any) -> None:
    """Keep the model's processor with its tokenizer, so that every component handed the tokenizer
    (prompt encoding, saving a model directory) finds the processor too."""
    tokenizer.weir_processor = processor


def processor_of(tokenizer: Any) -> Any | None:
    """The processor `attach_processor` kept with `tokenizer` (None for a text-only model)."""
    return getattr(tokenizer, "weir_processor", None)


# -- images -----------------------------------------------------------------------------------------


def _open(data: bytes, where: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError) as err:
        raise BadRow(f"{where}: not a readable image ({err})") from None
    return img.convert("RGB")


def load_image(ref: Any, *, allow_remote: bool = False, where: str = "image") -> Any:
    """An RGB PIL image from a path, a data URL, bytes, a PIL image or a ``{"bytes", "path"}`` dict.

    Raises `BadRow` (the row is skipped and counted) for a missing file, undecodable data, or a
    remote URL when `allow_remote` is False.
    """
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if isinstance(ref, bytes | bytearray):
        return _open(bytes(ref), where)
    if isinstance(ref, Mapping):
        if ref.get("bytes"):
            return _open(ref["bytes"], where)
        if ref.get("path"):
            return load_image(ref["path"], allow_remote=allow_remote, where=where)
        raise BadRow(f"{where}: an image dict needs 'bytes' or 'path', got keys {sorted(ref)}")
    if not isinstance(ref, str | Path):
        raise BadRow(
            f"{where}: an image must be a path, data URL or bytes, got {type(ref).__name__}"
        )
    s = str(ref)
    if s.startswith("data:"):
        head, _, payload = s.partition(",")
        if ";base64" not in head:
            raise BadRow(f"{where}: only base64 data URLs are read (data:image/png;base64,...)")
        try:
            return _open(base64.b64decode(payload, validate=True), where)
        except binascii.Error:
            raise BadRow(f"{where}: the data URL's base64 payload is malformed") from None
    if s.startswith(("http://", "https://")):
        if not allow_remote:
            raise BadRow(
                f"{where}: remote image URL {s[:80]!r} refused; pass the image as a file path or a "
                "data URL (remote fetching is off)"
            )
        import urllib.request

        with urllib.request.urlopen(s, timeout=30) as resp:  # noqa: S310 (explicitly allowed)
            return _open(resp.read(), where)
    path = Path(s).expanduser()
    if not path.is_file():
        raise BadRow(f"{where}: image file {s!r} not found")
    return _open(path.read_bytes(), where)


def image_data_url(img: Any, max_side: int | None = None) -> str:
    """A PNG data URL of PIL image `img` (downscaled to `max_side` when larger)."""
    if max_side is not None and max(img.size) > max_side:
        img = img.copy()
        img.thumbnail((max_side, max_side))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _reference(ref: Any, img: Any) -> str:
    """How an image is named in dumps and reports: its path or URL, else a PNG data URL."""
    if isinstance(ref, str | Path) and not str(ref).startswith("data:"):
        return str(ref)
    if isinstance(ref, str):
        return ref
    if isinstance(ref, Mapping) and ref.get("path") and not ref.get("bytes"):
        return str(ref["path"])
    return image_data_url(img)


def _part_image(part: Mapping[str, Any]) -> Any:
    kind = part.get("type")
    if kind == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, Mapping) else url
    for key in ("image", "path", "url"):
        if part.get(key) is not None:
            return part[key]
    return None


def vision_messages(
    row: Mapping[str, Any],
    *,
    prompt_key: str = "prompt",
    image_key: str = "images",
    system_prompt: str | None = None,
    allow_remote: bool = False,
) -> tuple[list[dict[str, Any]], list[Any], list[str]]:
    """The chat of `row` with every image part reduced to ``{"type": "image"}`` (what chat templates
    render as the image placeholder), the images in order of appearance, and their references.

    Images under `image_key` (one reference or a list) go before the text of the first user turn.
    """
    where = f"row {row['_index']}" if "_index" in row else "row"
    messages = prompt_messages(row, prompt_key=prompt_key, system_prompt=system_prompt)
    images: list[Any] = []
    refs: list[str] = []

    def take(ref: Any) -> dict[str, str]:
        img = load_image(ref, allow_remote=allow_remote, where=f"{where}, image {len(images)}")
        images.append(img)
        refs.append(_reference(ref, img))
        return {"type": "image"}

    out: list[dict[str, Any]] = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, Mapping) or "type" not in p:
                    raise BadRow(f"{where}: a content part must be a dict with 'type', got {p!r}")
                if p["type"] in ("image", "image_url"):
                    ref = _part_image(p)
                    if ref is None:
                        raise BadRow(f"{where}: an image part without an image: {dict(p)!r}")
                    parts.append(take(ref))
                elif p["type"] == "text":
                    parts.append({"type": "text", "text": str(p.get("text", ""))})
                else:
                    raise BadRow(f"{where}: unsupported content part type {p['type']!r}")
            content = parts
        out.append({**m, "content": content})
    extra = row.get(image_key)
    if extra is not None:
        extra = list(extra) if isinstance(extra, list | tuple) else [extra]
        first_user = next((m for m in out if m["role"] == "user"), None)
        if first_user is None:
            raise BadRow(f"{where}: {image_key!r} given but the chat has no user turn")
        text = first_user["content"]
        text_parts = text if isinstance(text, list) else [{"type": "text", "text": str(text)}]
        first_user["content"] = [take(ref) for ref in extra] + text_parts
    return out, images, refs


def encode_vision_prompt(
    processor: Any,
    row: Mapping[str, Any],
    *,
    prompt_key: str = "prompt",
    image_key: str = "images",
    system_prompt: str | None = None,
    max_prompt_tokens: int | None = None,
    allow_remote: bool = False,
) -> tuple[list[int], VisionInputs | None]:
    """Prompt ids and pixel inputs of `row` through the model's `processor` and chat template.

    The template renders each image as its placeholder; the processor then expands each placeholder
    to as many image tokens as the image has patches (after merging) and computes the pixels. A row
    without images gives ``(ids, None)``. Raises `BadRow` for a bad row or image, `PromptTooLong`
    when the ids exceed `max_prompt_tokens`.
    """
    messages, images, refs = vision_messages(
        row,
        prompt_key=prompt_key,
        image_key=image_key,
        system_prompt=system_prompt,
        allow_remote=allow_remote,
    )
    tokenizer = processor.tokenizer
    template = getattr(processor, "chat_template", None) or tokenizer.chat_template
    if not template:
        raise ValueError(
            "the model's processor has no chat template; a vision-language prompt needs one to place "
            "its images (add chat_template to the model directory)"
        )
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=template
    )
    ids, vision = process_vision_text(processor, text, images, refs)
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise PromptTooLong(len(ids), max_prompt_tokens, row.get("_index"))
    return ids, vision


def process_vision_text(
    processor: Any, text: str, images: list[Any], refs: list[str], **processor_kwargs: Any
) -> tuple[list[int], VisionInputs | None]:
    """Ids and pixel inputs of rendered `text` through the model's `processor`, which expands each
    image placeholder to the image's tokens: ``(ids, None)`` without images, else the processor's
    non-token outputs as `VisionInputs` (with the images' `refs`). `processor_kwargs` go to the
    processor call (e.g. ``add_special_tokens=False`` for a continuation)."""
    out = processor(text=[text], images=images or None, return_tensors="pt", **processor_kwargs)
    ids = [int(i) for i in out["input_ids"][0]]
    if not images:
        return ids, None
    return ids, VisionInputs({k: v for k, v in out.items() if k not in _TOKEN_KEYS}, refs)
