"""The vision-language path on CUDA: engine (fp32, then bf16) and trainer agree with images, on
Qwen2.5-VL and Qwen3-VL."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from weir.data.vision import encode_vision_prompt
from weir.data.vision_processor import load_processor
from weir.engine.base import SamplingParams
from weir.engine.torch_engine import TorchEngine
from weir.tasks.tiny_vlm import ARCHS, build_tiny_vlm
from weir.train.packing import response_logprobs

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)


def _prompts(processor):
    rows = []
    for colour, size in (("red", (48, 48)), ("blue", (64, 32))):
        img = Image.new("RGB", size, (128, 128, 128))
        ImageDraw.Draw(img).rectangle([2, 2, 20, 20], fill=colour)
        rows.append({"prompt": "Colour?", "images": [img]})
    return [encode_vision_prompt(processor, r) for r in rows]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_engine_and_trainer_agree_with_images_on_cuda(tmp_path, dtype, tol, arch):
    from transformers import AutoModelForImageTextToText

    path = build_tiny_vlm(tmp_path / "vlm", size="nano", arch=arch)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(CUDA).eval()
    processor = load_processor(path)
    enc = _prompts(processor)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, seed=0)
    try:
        futures = engine.submit_many(
            [i for i, _ in enc], SamplingParams(n=2, max_new_tokens=12, seed=2), [v for _, v in enc]
        )
        results = [f.result(timeout=300) for f in futures]
    finally:
        engine.close()
    seqs, lens, vis, lps = [], [], [], []
    for (ids, v), comps in zip(enc, results, strict=True):
        for c in comps:
            seqs.append(ids + c.token_ids)
            lens.append(len(c.token_ids))
            vis.append(v)
            lps.append(torch.tensor(c.logprobs, device=CUDA))
    with torch.no_grad():
        out = response_logprobs(model, seqs, lens, layout="padded", visions=vis)
    err = max((out.logprobs[i, : lens[i]] - lp).abs().mean().item() for i, lp in enumerate(lps))
    assert err < tol
