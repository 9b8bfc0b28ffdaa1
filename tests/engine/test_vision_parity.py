"""Vision-language prompts: the engine and the trainer see the same ids and the same pixels, and
their log-probs agree in float32 (1e-5) with each other and with the model's own HF forward, where
the model computes its multimodal rotary positions itself. Every test runs on both architectures
weir drives: Qwen2.5-VL and Qwen3-VL (interleaved M-RoPE, DeepStack features)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from weir.data.vision import encode_vision_prompt
from weir.data.vision_processor import load_processor
from weir.engine.base import SamplingParams
from weir.engine.torch_engine import TorchEngine
from weir.rollout.single_turn import RolloutContext, rollout
from weir.tasks.tiny_vlm import ARCHS, build_tiny_vlm
from weir.train.batch import make_batch
from weir.train.packing import response_logprobs

TOL = 1e-5


@pytest.fixture(scope="module", params=ARCHS)
def vlm(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    arch = request.param
    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / arch, size="nano", seed=0, arch=arch)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    assert model.config.model_type == arch
    for p in model.parameters():  # a larger init spreads the distribution: positions matter more
        p.data.mul_(3.0) if p.dim() > 1 else None
    return model, load_processor(path)


def _image(colour: str, size: tuple[int, int]) -> Image.Image:
    img = Image.new("RGB", size, (128, 128, 128))
    ImageDraw.Draw(img).ellipse([2, 2, size[0] // 2, size[1] // 2], fill=colour)
    return img


def _rows() -> list[dict]:
    return [
        {"prompt": "What colour?", "images": [_image("red", (48, 48))]},
        # a wide image (another grid, so other positions) and two images in one prompt
        {
            "prompt": "Compare these two, please",
            "images": [_image("blue", (64, 32)), _image("green", (32, 32))],
        },
        {"prompt": "A prompt without any image"},
    ]


def _hf_logprobs(model, ids, vision, response):
    """Reference: the model's own forward; it computes M-RoPE positions from mm_token_type_ids.
    The last response token is only a target (a sampled placeholder token has no pixels)."""
    t = torch.tensor([ids + response[:-1]])
    kw = dict(vision.tensors) if vision is not None else {}
    types = (t == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=t, mm_token_type_ids=types, **kw).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return torch.tensor([lp[len(ids) - 1 + i, tok].item() for i, tok in enumerate(response)])


def test_engine_trainer_and_hf_logprobs_agree_with_images(vlm):
    model, processor = vlm
    enc = [encode_vision_prompt(processor, r) for r in _rows()]
    assert [v is None for _, v in enc] == [False, False, True]
    assert enc[1][1].tensors["image_grid_thw"].tolist() == [[1, 4, 8], [1, 4, 4]]
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, seed=0)
    try:
        futures = engine.submit_many(
            [ids for ids, _ in enc],
            SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=5),
            [v for _, v in enc],
        )
        results = [f.result(timeout=120) for f in futures]
    finally:
        engine.close()
    seqs, lens, visions, engine_lp = [], [], [], []
    for (ids, vision), comps in zip(enc, results, strict=True):
        for c in comps:
            assert c.token_ids, "a completion with no tokens"
            ref = _hf_logprobs(model, ids, vision, c.token_ids)
            assert (ref - torch.tensor(c.logprobs)).abs().max().item() < TOL
            seqs.append(ids + c.token_ids)
            lens.append(len(c.token_ids))
            visions.append(vision)
            engine_lp.append(torch.tensor(c.logprobs))
    for layout in ("padded", "packed"):
        with torch.no_grad():
            out = response_logprobs(model, seqs, lens, layout=layout, visions=visions)
        for i, lp in enumerate(engine_lp):
            err = (out.logprobs[i, : lens[i]] - lp).abs().max().item()
            assert err < TOL, f"{layout}: sequence {i} differs by {err}"


def test_positions_matter_the_rope_delta_is_not_zero(vlm):
    """Decoding at len(prompt) instead of len(prompt) + delta changes the log-probs: the agreement
    above is a real check of the decode positions, not a coincidence of equal numbers."""
    model, processor = vlm
    ids, vision = encode_vision_prompt(processor, _rows()[0])
    from weir.data.vision_model import vision_model

    pos, delta = vision_model(model).positions(ids, vision)
    # 9 image tokens on a 3x3 grid advance the position by 3, not 9
    assert delta == -6 and int(pos.max()) == len(ids) + delta - 1
    t = torch.tensor([ids])
    with torch.no_grad():
        right = model(input_ids=t, position_ids=pos[:, None], **vision.tensors).logits[0, -1]
        text_pos = torch.arange(len(ids))[None]
        wrong = model(input_ids=t, position_ids=text_pos, **vision.tensors).logits[0, -1]
    assert (torch.log_softmax(right, -1) - torch.log_softmax(wrong, -1)).abs().max() > 1e-3


def test_engine_and_trainer_see_the_same_ids_and_pixels(vlm):
    """Record every forward's input ids and pixels: the engine's prefill row (its left padding
    removed) and the trainer's row are the sample's prompt ids, and both carry the prompt's pixels."""
    model, processor = vlm
    seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def record(module, args, kwargs):
        seen.append((kwargs["input_ids"].clone(), kwargs.get("pixel_values")))

    row = {"prompt": "How many?", "images": [_image("yellow", (48, 48))]}
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, seed=0)
    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        ctx = RolloutContext(
            engine=engine,
            tokenizer=processor.tokenizer,
            sampling=SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=1),
            reward_fn=lambda s, r: 1.0,
            encode=lambda r: [],
            encode_vision=lambda r: encode_vision_prompt(processor, r),
        )
        group = asyncio.run(rollout(ctx, row))
        engine_calls = list(seen)
        seen.clear()
        batch = make_batch([group], version=0)
        with torch.no_grad():
            response_logprobs(
                model,
                batch.sequences,
                batch.response_lengths,
                layout="padded",
                visions=batch.visions,
            )
    finally:
        handle.remove()
        engine.close()
    expected_ids, expected = encode_vision_prompt(processor, row)
    for s in group.samples:
        assert s.prompt_ids == expected_ids and s.vision.equal(expected)
    (prefill_ids, prefill_pixels), *decodes = engine_calls
    assert prefill_ids[0].tolist() == expected_ids  # the prompt prefilled once for its n samples
    assert torch.equal(prefill_pixels, expected.tensors["pixel_values"])
    assert decodes and all(ids.shape[1] == 1 and p is None for ids, p in decodes)
    ((train_ids, train_pixels),) = seen
    for i, s in enumerate(batch.samples):
        row_ids = train_ids[i].tolist()
        assert row_ids[len(row_ids) - s.num_tokens :][: len(expected_ids)] == expected_ids
    pv = expected.tensors["pixel_values"]
    assert torch.equal(train_pixels, torch.cat([pv, pv]))  # one copy per sample, in row order


def test_refusals(vlm, tiny_model_dir):
    model, processor = vlm
    ids, vision = encode_vision_prompt(processor, _rows()[0])
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    try:
        with pytest.raises(ValueError, match="image tokens but no pixel inputs"):
            engine.submit(ids, SamplingParams(max_new_tokens=2)).result(timeout=60)
        short = [i for i in ids if i != model.config.image_token_id][:5] + ids[1:3]
        with pytest.raises(ValueError, match="image tokens for"):
            engine.submit(short, SamplingParams(max_new_tokens=2), vision).result(timeout=60)
    finally:
        engine.close()
    from transformers import AutoModelForCausalLM

    text = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = TorchEngine(text, eos_token_ids=[1], pad_token_id=0)
    try:
        with pytest.raises(ValueError, match="text-only"):
            engine.submit([5, 6, 7], SamplingParams(max_new_tokens=2), vision).result(timeout=60)
    finally:
        engine.close()


def test_weight_update_mid_generation_rebuilds_the_kv_with_the_pixels(vlm):
    """After an update the engine re-prefills the rows in flight, images included: every token after
    the update has the new model's log-prob, every token before it the old model's."""
    import copy
    import time

    model, processor = vlm
    ids, vision = encode_vision_prompt(processor, _rows()[1])
    old = copy.deepcopy(model)
    new = _perturbed(model)
    engine = TorchEngine(copy.deepcopy(model), eos_token_ids=[], pad_token_id=0, seed=0)
    try:
        fut = engine.submit(ids, SamplingParams(n=2, max_new_tokens=200, seed=7), vision)
        while engine.stats()["generated_tokens"] < 4:
            time.sleep(0.001)
        engine.update_weights_sync(list(new.named_parameters()), version=1)
        comps = fut.result(timeout=120)
    finally:
        engine.close()
    for c in comps:
        versions = torch.tensor(c.versions)
        assert 0 < int((versions == 1).sum()) < len(c.token_ids), (
            "the update must fall mid-response"
        )
        got = torch.tensor(c.logprobs)
        before, after = versions == 0, versions == 1
        ref_old = _hf_logprobs(old, ids, vision, c.token_ids)
        ref_new = _hf_logprobs(new, ids, vision, c.token_ids)
        assert (got[before] - ref_old[before]).abs().max() < TOL
        assert (got[after] - ref_new[after]).abs().max() < TOL


def test_text_only_prompts_that_open_alike_on_a_vision_language_model(vlm):
    """A vision-language model computes its rotary positions over the whole prompt, so the engine
    never splits a prefill of it into a shared prefix and the rest: episodes of one text-only
    prompt, admitted together and rebuilt after an update, are prefilled whole and keep the model's
    own log-probs."""
    import copy
    import time

    model, processor = vlm
    ids, vision = encode_vision_prompt(processor, _rows()[2])
    new = _perturbed(model)
    engine = TorchEngine(copy.deepcopy(model), eos_token_ids=[], pad_token_id=0, seed=0)
    try:
        engine.pause_sync()
        futs = engine.submit_many([ids] * 4, SamplingParams(n=1, max_new_tokens=60, seed=7))
        engine.resume_sync()
        while engine.stats()["generated_tokens"] < 8:
            time.sleep(0.001)
        engine.update_weights_sync(list(new.named_parameters()), version=1)
        results = [f.result(timeout=120) for f in futs]
        assert engine.stats()["shared_prefix_tokens"] == 0
    finally:
        engine.close()
    for (c,) in results:
        versions = torch.tensor(c.versions)
        got, after = torch.tensor(c.logprobs), versions == 1
        assert bool(after.any())
        ref_new = _hf_logprobs(new, ids, vision, c.token_ids)
        assert (got[after] - ref_new[after]).abs().max() < TOL


def _perturbed(model):
    """A copy of `model` with every weight moved by 0.05 standard normal noise: the next version."""
    import copy

    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return new


def test_other_vision_language_architectures_are_refused():
    """Qwen2-VL and SmolVLM take images too, but weir has not checked their positions and pixels:
    they are refused by name instead of being run with wrong numbers."""
    from transformers import Qwen2VLConfig, SmolVLMConfig

    from weir.data.vision_model import vision_model

    for config in (Qwen2VLConfig(), SmolVLMConfig()):
        model = torch.nn.Module()
        model.config = config
        with pytest.raises(ValueError, match=f"vision-language architecture '{config.model_type}'"):
            vision_model(model)


def test_tiny_vlm_paths_name_the_architecture(tmp_path):
    import json

    from weir.train.model import resolve_model_path

    for path, arch in (("tiny-vlm:nano", "qwen2_5_vl"), ("tiny-vlm:nano:qwen3_vl", "qwen3_vl")):
        out = resolve_model_path(path, tmp_path)
        assert json.loads((Path(out) / "config.json").read_text())["model_type"] == arch
        assert type(load_processor(out)).__name__.startswith("Image")  # images only, no torchvision
    with pytest.raises(ValueError, match="unknown tiny VLM architecture 'llava'"):
        resolve_model_path("tiny-vlm:nano:llava", tmp_path)


def test_a_tiny_vlm_loads_its_image_processor_where_autoprocessor_would_not(tmp_path, monkeypatch):
    """transformers before 5.20 (5.17 on the GPU image) looks a saved `processor_class` up among
    its own classes only and hands back the bare tokenizer; weir's image-only classes load anyway.
    The directory also carries preprocessor_config.json, as released checkpoints do."""
    import transformers

    from weir.data import vision_processor

    path = build_tiny_vlm(tmp_path / "vlm", size="nano", arch="qwen3_vl")
    assert (path / "preprocessor_config.json").exists()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    monkeypatch.setattr(
        vision_processor.AutoProcessor, "from_pretrained", lambda *a, **k: tokenizer
    )
    processor = load_processor(path)
    assert type(processor).__name__ == "ImageQwen3VLProcessor"
    assert processor.image_processor is not None
    (
        path / "processor_config.json"
    ).unlink()  # a directory naming no class of weir's: AutoProcessor
    (path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no image processor"):
        load_processor(path)
