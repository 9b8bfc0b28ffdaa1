"""Image prompts: where images come from, how a row becomes ids + pixels, and what is refused."""

from __future__ import annotations

import base64
import dataclasses
import io

import pytest
import torch
from PIL import Image

from weir.data.prompts import BadRow
from weir.data.sample import Sample
from weir.data.vision import VisionInputs, encode_vision_prompt, load_image, vision_messages
from weir.tasks.tiny_vlm import build_vlm_processor


@pytest.fixture(scope="module")
def processor():
    return build_vlm_processor()


def _png(colour=(200, 10, 10), size=(32, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_every_image_reference_gives_the_same_pixels(tmp_path):
    data = _png()
    path = tmp_path / "a.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    refs = [data, str(path), url, {"bytes": data, "path": None}, {"path": str(path)}]
    arrays = [load_image(r).tobytes() for r in refs]
    assert all(a == arrays[0] for a in arrays)
    assert load_image(data).size == (32, 16) and arrays[0][:3] == bytes([200, 10, 10])


@pytest.mark.parametrize(
    ("ref", "match"),
    [
        ("https://example.com/cat.png", "remote image URL"),
        ("/no/such/file.png", "not found"),
        ("data:image/png;base64,@@@", "malformed"),
        (b"not an image", "not a readable image"),
        (12, "must be a path"),
    ],
)
def test_bad_images_are_bad_rows(ref, match):
    with pytest.raises(BadRow, match=match):
        load_image(ref)


def test_images_go_before_the_text_and_chat_parts_are_read(processor):
    data = _png()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    msgs, images, refs = vision_messages({"prompt": "Count", "images": [data, data]})
    assert msgs == [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Count"}],
        }
    ]
    assert len(images) == 2 and refs[0].startswith("data:image/png;base64,")
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            },
        ]
    }
    msgs, images, refs = vision_messages(chat)
    assert msgs[1]["content"] == [{"type": "text", "text": "What is"}, {"type": "image"}]
    assert refs == [url]
    with pytest.raises(BadRow, match="unsupported content part"):
        vision_messages({"messages": [{"role": "user", "content": [{"type": "audio"}]}]})


@pytest.mark.hf_compat  # also run against the oldest supported transformers
def test_encoded_prompt_is_token_exact(processor):
    """One <|image_pad|> per merged patch, between vision_start/end, in the template's place; the
    pixels are the image processor's own output for that image."""
    img = Image.new("RGB", (64, 32), (10, 200, 10))
    ids, vis = encode_vision_prompt(processor, {"prompt": "Hi", "images": [img]})
    tok = processor.tokenizer
    pad, start, end = (
        tok.convert_tokens_to_ids(t)
        for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
    )
    # 64x32 pixels, patch 8 -> 8x4 patches, 2x2 merge -> 8 tokens
    expected = (
        tok("<|user|>", add_special_tokens=False)["input_ids"]
        + [start]
        + [pad] * 8
        + [end]
        + tok("Hi<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    )
    assert ids == expected
    assert vis.tensors["image_grid_thw"].tolist() == [[1, 4, 8]]
    own = processor.image_processor(images=[img], return_tensors="pt")
    assert torch.equal(vis.tensors["pixel_values"], own["pixel_values"])
    text_ids, none = encode_vision_prompt(processor, {"prompt": "Hi"})
    assert none is None and pad not in text_ids


def test_sample_vision_survives_asdict(processor):
    """The buffer persists groups as `dataclasses.asdict`; the pixels come back bit for bit."""
    ids, vis = encode_vision_prompt(processor, {"prompt": "Hi", "images": [_png()]})
    s = Sample(prompt_ids=ids, response_ids=[5], vision=vis)
    back = Sample(**dataclasses.asdict(s))
    assert isinstance(back.vision, VisionInputs) and back.vision.equal(vis)
    assert back.vision.images == vis.images


def test_concat_keeps_row_order(processor):
    _, a = encode_vision_prompt(processor, {"prompt": "a", "images": [_png(size=(32, 32))]})
    _, b = encode_vision_prompt(processor, {"prompt": "b", "images": [_png(size=(64, 32))]})
    out = VisionInputs.concat([b, None, a], "cpu")
    assert out["image_grid_thw"].tolist() == [[1, 4, 8], [1, 4, 4]]
    assert out["pixel_values"].shape[0] == 32 + 16
