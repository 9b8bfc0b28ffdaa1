"""What the tiny VLM's vision tower passes on about a shapes image, before any training.

The shapes demo once learned counting but not colour (55% after SFT, two colour pairs confused).
These probes rule out the vision side: the colour and the number of shapes are readable, by a
linear map, from the untrained tower's output, so what the decoder learns is up to the SFT data
(see docs/multimodal.md, "Why colour did not learn").
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText

from weir.tasks.shapes import COLOURS, SIDE, draw
from weir.tasks.tiny_vlm import build_tiny_vlm, build_vlm_processor

N_TRAIN, N_TEST = 240, 120


@pytest.fixture(scope="module")
def tower_features(tmp_path_factory):
    """Mean-pooled image tokens of the untrained tiny-vlm:nano tower, with colour and count."""
    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm"), "nano")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    drawn = [draw(seed) for seed in range(N_TRAIN + N_TEST)]
    inputs = build_vlm_processor().image_processor(
        images=[img for img, _, _ in drawn], return_tensors="pt"
    )
    grid = inputs["image_grid_thw"]
    assert grid[0].tolist() == [1, SIDE // 8, SIDE // 8]  # 8-pixel patches
    with torch.no_grad():
        out = model.model.get_image_features(inputs["pixel_values"], image_grid_thw=grid)
    tokens = out.pooler_output if hasattr(out, "pooler_output") else out
    tokens = torch.stack(list(tokens)) if isinstance(tokens, (list, tuple)) else tokens
    feats = tokens.reshape(len(drawn), -1, tokens.shape[-1]).mean(1)
    colours = torch.tensor([sorted(COLOURS).index(c) for _, _, c in drawn])
    counts = torch.tensor([n - 1 for _, n, _ in drawn])
    return feats, colours, counts


def _probe_accuracy(x: torch.Tensor, y: torch.Tensor, classes: int) -> float:
    """Held-out accuracy of a ridge regression onto one-hot labels, fitted on the first N_TRAIN."""
    x = (x - x[:N_TRAIN].mean(0)) / (x[:N_TRAIN].std(0) + 1e-6)
    x = torch.cat([x, torch.ones(len(x), 1)], 1).double()
    target = torch.nn.functional.one_hot(y, classes).double()
    a, b = x[:N_TRAIN], target[:N_TRAIN]
    w = torch.linalg.solve(a.T @ a + 10.0 * torch.eye(a.shape[1], dtype=a.dtype), a.T @ b)
    return float(((x[N_TRAIN:] @ w).argmax(1) == y[N_TRAIN:]).double().mean())


def test_the_untrained_vision_tower_passes_colour_and_count_on(tower_features):
    feats, colours, counts = tower_features
    assert _probe_accuracy(feats, colours, 4) >= 0.95
    # chance is 25-30% (the most frequent count); a probe of shuffled labels stays near it
    assert _probe_accuracy(feats, counts, 4) >= 0.5
    shuffled = counts[torch.randperm(len(counts), generator=torch.Generator().manual_seed(0))]
    assert _probe_accuracy(feats, shuffled, 4) < 0.4
