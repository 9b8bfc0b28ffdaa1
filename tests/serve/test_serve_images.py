"""`image_url` content parts on the OpenAI-compatible server: data URLs reach the engine as the
processor's ids and pixels; remote URLs are refused unless allowed; a text-only model refuses images."""

from __future__ import annotations

import base64
import io

import openai
import pytest
from PIL import Image

from weir.data.vision import encode_vision_prompt
from weir.data.vision_processor import load_processor
from weir.engine.base import SamplingParams
from weir.engine.torch_engine import TorchEngine
from weir.serve import Server
from weir.tasks.tiny_vlm import build_tiny_vlm


class Recording:
    """Delegates to a TorchEngine and keeps what each call was given."""

    def __init__(self, engine):
        self.inner = engine
        self.eos_token_ids = engine.eos_token_ids
        self.version = 0
        self.calls = []

    async def generate(self, prompt_ids, params, vision=None):
        self.calls.append((list(prompt_ids), vision, params))
        return await self.inner.generate(prompt_ids, params, vision)


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "nano", size="nano", seed=1)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = load_processor(path)
    tok = processor.tokenizer
    tok.weir_processor = processor
    engine = TorchEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    rec = Recording(engine)
    with Server(rec, tok, model_name="vlm", admin_key="admin") as srv:
        yield srv, rec, processor
    engine.close()


def _data_url(colour) -> tuple[str, Image.Image]:
    img = Image.new("RGB", (48, 32), colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), img


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="admin", max_retries=0)


def test_image_url_reaches_the_engine_as_ids_and_pixels(vlm_server):
    srv, rec, processor = vlm_server
    url, img = _data_url((200, 30, 30))
    rec.calls.clear()
    out = _client(srv).chat.completions.create(
        model="vlm",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Colour? "},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        max_tokens=6,
        temperature=0,
    )
    ((ids, vision, params),) = rec.calls
    row = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Colour? "}, {"type": "image", "image": img}],
            }
        ]
    }
    want_ids, want = encode_vision_prompt(processor, row)
    assert ids == want_ids and vision.equal(want)
    # the reply is what the engine decodes greedily for exactly these ids and pixels
    direct = rec.inner.submit(
        want_ids, SamplingParams(temperature=0, max_new_tokens=6), want
    ).result(60)
    text = processor.tokenizer.decode(direct[0].token_ids, skip_special_tokens=True)
    assert out.choices[0].message.content == text
    assert out.usage.prompt_tokens == len(want_ids)


def test_remote_urls_are_refused(vlm_server):
    srv, rec, _ = vlm_server
    with pytest.raises(openai.BadRequestError, match="remote image URL"):
        _client(srv).chat.completions.create(
            model="vlm",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
                    ],
                }
            ],
            max_tokens=2,
        )


def test_a_text_only_model_refuses_images(engine, tokenizer):
    url, _ = _data_url((0, 0, 255))
    with Server(engine, tokenizer, model_name="tiny", admin_key="admin") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="admin", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="takes no images"):
            client.chat.completions.create(
                model="tiny",
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
                ],
                max_tokens=2,
            )


def test_a_session_records_its_images_and_trains_as_the_engine_sampled(vlm_server):
    """Two calls of one recorded session, each with a new screen: the second extends the first
    token for token (its prompt is the first prompt + the reply + the new message, its pixels both
    images), and the session's sample carries both images; the trainer's log-probs of its sampled
    tokens are the engine's (float32, 1e-5). (KV reuse across such turns is tested with the
    engine directly in tests/rollout/test_vision_episodes.py.)"""
    import httpx
    import torch

    from weir.train.packing import response_logprobs

    srv, rec, processor = vlm_server
    session = srv.sessions.open({"task": "screens"})
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=session.api_key, max_retries=0)
    first, _ = _data_url((200, 30, 30))
    second, _ = _data_url((30, 30, 200))
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": first}},
                {"type": "text", "text": "Goal: find blue."},
            ],
        }
    ]
    rec.calls.clear()
    reply = client.chat.completions.create(model="vlm", messages=chat, max_tokens=5, seed=1)
    chat += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": second}}]},
    ]
    client.chat.completions.create(model="vlm", messages=chat, max_tokens=5, seed=2)
    (ids1, vision1, _), (ids2, vision2, _) = rec.calls
    turn1 = session.turns[0]
    assert ids2[: len(turn1.context)] == turn1.context  # linked: nothing re-tokenized
    assert vision1.num_images == 1 and vision2.num_images == 2
    (sample,) = session.to_samples()
    assert sample.vision.equal(vision2) and sample.vision.images == [first, second]
    assert sample.prompt_ids == ids1
    seq = sample.prompt_ids + sample.response_ids
    with torch.no_grad():
        out = response_logprobs(
            rec.inner.model,
            [seq],
            [len(sample.response_ids)],
            layout="padded",
            visions=[sample.vision],
        )
    mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
    err = (out.logprobs[0, : len(mask)] - torch.tensor(sample.rollout_logprobs))[mask].abs().max()
    assert err.item() < 1e-5
    # the trajectory endpoint names the session's images
    traj = httpx.get(
        f"{srv.url}/v1/sessions/{session.id}/trajectory",
        headers={"Authorization": f"Bearer {session.api_key}"},
    ).json()
    assert traj["segments"][0]["images"] == [first, second]
    assert traj["segments"][0]["loss_mask"] == sample.loss_mask
