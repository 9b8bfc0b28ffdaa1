"""Images in multi-turn episodes (weir.rollout.vision_episode): an environment shows the tiny VLM a
new screen every turn; the engine prefills each turn with its pixels, reusing the previous turn's
KV; the trainer, given the sample's ids and pixels, computes the engine's log-probs (float32,
1e-5 per token), in every layout, and so does the model's own forward over the whole conversation
(where HF computes the multimodal positions itself). Image memory that drops old screens makes
one sample per segment, each with exactly the ids and pixels the engine had."""

from __future__ import annotations

import asyncio

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import AutoModelForImageTextToText

from weir.config.schema import AgentConfig, VisionConfig
from weir.data.sample import Status
from weir.data.vision import attach_processor, encode_vision_prompt
from weir.data.vision_processor import load_processor
from weir.data.vision_spans import image_spans, select_images
from weir.engine.base import SamplingParams
from weir.engine.torch_engine import TorchEngine
from weir.rollout import multi_turn
from weir.rollout.observation import Observation
from weir.rollout.single_turn import RolloutContext
from weir.tasks.tiny_vlm import ARCHS, build_tiny_vlm
from weir.train.packing import response_logprobs

TOL = 1e-5
COLOURS = ["red", "green", "yellow", "blue"]


@pytest.fixture(scope="module", params=ARCHS)
def vlm(request, tmp_path_factory):
    arch = request.param
    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / arch, size="nano", seed=0, arch=arch)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    for p in model.parameters():  # a larger init spreads the distribution: positions matter more
        p.data.mul_(3.0) if p.dim() > 1 else None
    processor = load_processor(path)
    attach_processor(processor.tokenizer, processor)
    return model, processor


def screen(colour: str, size=(32, 32)) -> Image.Image:
    img = Image.new("RGB", size, (128, 128, 128))
    ImageDraw.Draw(img).ellipse([2, 2, size[0] // 2, size[1] // 2], fill=colour)
    return img


class Screens:
    """A new screen each step (alternating sizes: other image grids, other positions); done after
    three steps. Step rewards 0.25, 0.5, 1.0."""

    def reset(self, row):
        self.t = 0
        return Observation("Find the red dot.", [screen("blue")])

    def step(self, action):
        self.t += 1
        if self.t == 3:
            return None, 1.0, True, {}
        size = (48, 32) if self.t == 1 else (32, 32)
        obs = Observation(
            f"screen {self.t}", [screen(COLOURS[self.t], size)], f"a {COLOURS[self.t]} dot"
        )
        return obs, 0.25 * self.t, False, {}


def run(model, processor, vision: VisionConfig, prefix_cache: bool = True, n: int = 2):
    """A group of `n` episodes of `Screens`; every engine call is recorded."""
    tok = processor.tokenizer
    engine = TorchEngine(
        model, eos_token_ids=[tok.eos_token_id], pad_token_id=0, seed=0, prefix_cache=prefix_cache
    )
    calls = []
    generate = engine.generate

    async def recorded(ids, params, vision=None):
        calls.append((list(ids), vision))
        return await generate(ids, params, vision)

    engine.generate = recorded
    # A random model rarely samples its end token; stopping on most ids keeps turns short.
    stops = [processor.image_token_id, processor.video_token_id, *range(40, 200)]
    ctx = RolloutContext(
        engine=engine,
        tokenizer=tok,
        sampling=SamplingParams(
            n=n, temperature=1.0, max_new_tokens=8, seed=3, stop_token_ids=stops
        ),
        reward_fn=lambda s, r: 1.0,
        encode=lambda r: [],
        encode_vision=lambda r: encode_vision_prompt(processor, r),
        extras={
            "agent": AgentConfig(env="tests:Screens", max_turns=4, max_tokens=400, reward="task"),
            "vision": vision,
        },
    )
    make_env = multi_turn.make_env
    multi_turn.make_env = lambda agent: Screens()
    try:
        group = asyncio.run(multi_turn.rollout(ctx, {"prompt": "unused", "_index": 0}))
    finally:
        multi_turn.make_env = make_env
        stats = engine.stats()
        engine.close()
    return group, stats, calls


def hf_logprobs(model, sample) -> torch.Tensor:
    """The model's own forward over prompt + response with every image's pixels (HF computes the
    M-RoPE positions from mm_token_type_ids)."""
    t = torch.tensor([sample.prompt_ids + sample.response_ids])
    types = (t == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=t, mm_token_type_ids=types, **sample.vision.tensors).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    p = len(sample.prompt_ids)
    return torch.tensor([lp[p - 1 + i, tok].item() for i, tok in enumerate(sample.response_ids)])


def trainer_errors(model, samples) -> dict[str, float]:
    """Largest |trainer - engine| log-prob over the policy tokens, per layout."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    lens = [len(s.response_ids) for s in samples]
    out = {}
    for layout in ("padded", "packed", "prefix"):
        with torch.no_grad():
            lp = response_logprobs(
                model, seqs, lens, layout=layout, visions=[s.vision for s in samples]
            ).logprobs
        out[layout] = max(
            (
                (lp[i, : lens[i]] - torch.tensor(s.rollout_logprobs)).abs()
                * torch.tensor(s.loss_mask)
            )
            .max()
            .item()
            for i, s in enumerate(samples)
        )
    return out


def test_image_observations_engine_equals_trainer_across_turns_with_kv_reuse(vlm):
    model, processor = vlm
    group, stats, calls = run(model, processor, VisionConfig())
    assert len(group.samples) == 2
    for s in group.samples:
        assert s.status == Status.COMPLETED and s.reward_info["stop"] == "done"
        assert s.reward_info["turns"] == 3 and s.vision.num_images == 3  # reset + two screens
        spans = image_spans(s.prompt_ids + s.response_ids, processor.image_token_id)
        assert len(spans) == 3 and all(
            s.loss_mask[a - len(s.prompt_ids)] == 0 for a, _ in spans[1:]
        )
        assert s.reward_info["env_rewards"] == [0.25, 0.5, 1.0]
        ref = hf_logprobs(model, s)
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert (ref - torch.tensor(s.rollout_logprobs))[mask].abs().max().item() < TOL
    errs = trainer_errors(model, group.samples)
    assert all(e < TOL for e in errs.values()), errs
    # turns 2 and 3 of both episodes continued the previous turn's KV (none recomputed its image)
    assert stats["prefix_hits"] == 4 and stats["prefix_reused_tokens"] > 0
    # each turn's engine call: a sample's ids so far and the pixels of the images among them
    assert len(calls) == 6
    for ids, vision in calls:
        s = next(s for s in group.samples if (s.prompt_ids + s.response_ids)[: len(ids)] == ids)
        k = len(image_spans(ids, processor.image_token_id))
        assert vision.equal(select_images(s.vision, list(range(k))))


def test_kv_reuse_changes_nothing(vlm):
    """The same seeded episodes with the prefix cache off: the same tokens and log-probs."""
    model, processor = vlm
    with_cache, _, _ = run(model, processor, VisionConfig())
    without, stats, _ = run(model, processor, VisionConfig(), prefix_cache=False)
    assert stats.get("prefix_hits", 0) == 0
    for a, b in zip(with_cache.samples, without.samples, strict=True):
        assert a.response_ids == b.response_ids
        diff = (torch.tensor(a.rollout_logprobs) - torch.tensor(b.rollout_logprobs)).abs().max()
        assert diff.item() < TOL


@pytest.mark.parametrize("memory", ["drop", "summary"])
def test_dropped_images_make_segments_trained_as_the_engine_saw_them(vlm, memory):
    model, processor = vlm
    tok = processor.tokenizer
    group, _, calls = run(model, processor, VisionConfig(episode_memory=memory, keep_images=1), n=1)
    samples = group.samples
    # keep_images=1: every screen replaces the one before, so each model turn is its own segment
    assert [s.metadata["segment"] for s in samples] == [0, 1, 2]
    assert [s.metadata["turn_offset"] for s in samples] == [0, 1, 2]
    assert all(s.metadata["segments"] == 3 and s.metadata["episode"] == 0 for s in samples)
    for s, (ids, vision) in zip(samples, calls, strict=True):
        assert s.prompt_ids == ids  # the segment's prompt is the rewritten context the engine saw
        assert s.vision.num_images == vision.num_images == 1
        assert s.vision.equal(vision)
        assert all(s.loss_mask)  # one model turn each
    stand_in = "[image]" if memory == "drop" else "a green dot"  # screen 1, dropped for screen 2
    assert stand_in in tok.decode(samples[2].prompt_ids)
    assert "[image]" in tok.decode(samples[1].prompt_ids)  # the reset screen has no summary
    errs = trainer_errors(model, samples)
    assert all(e < TOL for e in errs.values()), errs


def test_image_token_bound_ends_the_episode(vlm):
    model, processor = vlm
    # the reset screen is 4 image tokens, the first observation's 6 more: over a bound of 8
    group, _, _ = run(model, processor, VisionConfig(max_image_tokens=8), n=1)
    (s,) = group.samples
    assert s.status == Status.TRUNCATED and s.reward_info["stop"] == "image_tokens"
    assert s.reward_info["turns"] == 1 and s.vision.num_images == 1


def test_a_kept_turn_is_not_reused_for_other_images_with_the_same_ids(vlm):
    """Every image token is the same id: a conversation with another picture must not continue
    the KV of this one (the prefix cache keys entries by their images' pixels too)."""
    model, processor = vlm
    tok = processor.tokenizer
    ids, red = encode_vision_prompt(processor, {"prompt": "dot?", "images": [screen("red")]})
    _, blue = encode_vision_prompt(processor, {"prompt": "dot?", "images": [screen("blue")]})
    engine = TorchEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=0, seed=0)
    stops = list(range(40, 200))
    try:
        keep = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1, stop_token_ids=stops)
        keep.keep_kv = True
        (c,) = engine.submit(ids, keep, red).result(timeout=60)
        follow = ids + c.token_ids + tok("more", add_special_tokens=False)["input_ids"]
        probe = SamplingParams(temperature=1.0, max_new_tokens=2, seed=2, stop_token_ids=stops)
        (other,) = engine.submit(follow, probe, blue).result(timeout=60)
        assert engine.stats()["prefix_hits"] == 0
        (same,) = engine.submit(follow, probe, red).result(timeout=60)
        assert engine.stats()["prefix_hits"] == 1
    finally:
        engine.close()
    for vision, comp in ((blue, other), (red, same)):
        from weir.data.sample import Sample

        s = Sample(follow, comp.token_ids, vision=vision)
        ref = hf_logprobs(model, s)
        assert (ref - torch.tensor(comp.logprobs)).abs().max().item() < TOL


def test_text_only_model_fails_an_image_observation_as_an_env_error():
    from weir.rollout.multi_turn import _EnvFailure, _observation_ids, observation_codec
    from weir.tasks.tiny_model import build_tokenizer

    codec = observation_codec(build_tokenizer())
    agent = AgentConfig(max_tokens=64)
    assert _observation_ids(None, codec, [{"type": "text", "text": "ok"}], [1], agent)
    with pytest.raises(_EnvFailure, match="takes none"):
        _observation_ids(None, codec, Observation("x", [screen("red")]), [1], agent)
    with pytest.raises(_EnvFailure, match="content part"):
        _observation_ids(None, codec, [{"type": "audio"}], [1], agent)
