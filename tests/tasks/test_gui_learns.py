"""The GUI task is learnable by weir's tiny VLM: SFT on the expert's demonstrations teaches it to
read where an element is on the screen, and its greedy clicks then reach held-out goals.

The tiny VLM needs several hundred optimizer steps before its clicks depend on the screen: until
then the coordinate tokens stay at chance (the SFT loss plateaus near log 2 per coordinate), and
then drop within ~150 steps. The demo once ran 38 SFT steps (600 rows, batch 32, 2 epochs), which
is why its success stayed at chance. This test runs 750 steps on `press` goals and plays held-out
goals through the environment.
"""

from __future__ import annotations

import pytest
import torch

from weir.config.schema import SFTConfig
from weir.data.vision import encode_vision_prompt
from weir.tasks import gui
from weir.tasks.tiny_vlm import build_tiny_vlm
from weir.train.sft import sft

pytestmark = pytest.mark.slow


def _encode(processor, messages):
    return encode_vision_prompt(processor, {"messages": messages}, image_key="images")


def _greedy(model, ids: list[int], vision, eos: int, limit: int = 16) -> list[int]:
    """Greedy decoding by whole forwards (the sequences are ~30 tokens): M-RoPE positions from the
    model's own `get_rope_index` (`mm_token_type_ids` marks the image tokens)."""
    out: list[int] = []
    image = model.config.image_token_id
    for _ in range(limit):
        x = torch.tensor([ids + out])
        logits = model(
            input_ids=x, mm_token_type_ids=(x == image).long(), **vision.to("cpu")
        ).logits
        nxt = int(logits[0, -1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
    return out


def _success(model, processor, rows) -> float:
    """Held-out task-level success: the goal reached by the first greedy action."""
    tok = processor.tokenizer
    wins = 0
    model.eval()
    with torch.no_grad():
        for row in rows:
            env = gui.GuiEnv()
            first = env.reset({**row, "max_actions": 1})
            ids, vision = _encode(processor, [{"role": "user", "content": first.parts()}])
            action = tok.decode(_greedy(model, ids, vision, tok.eos_token_id))
            _, _, done, info = env.step(action)
            wins += bool(info["success"])
    return wins / len(rows)


def test_sft_on_demonstrations_makes_greedy_clicks_reach_held_out_goals(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(0)
    torch.set_num_threads(1)
    path = build_tiny_vlm(tmp_path / "vlm", size="tiny", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(path)
    tok = processor.tokenizer
    held_out = gui.make_rows("test", 48, seed=0, kinds="press")
    assert _success(model, processor, held_out) == 0.0  # the untrained model emits no action

    examples = []
    for row in gui.sft_rows(4000, seed=0, kinds="press"):
        ids, vision = _encode(processor, row["messages"])
        target = tok(row["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        examples.append((ids, target, vision))
    cfg = SFTConfig(rows=len(examples), epochs=3, batch_size=16, lr=2e-3)  # 750 steps
    sft(model.train(), examples, cfg, seed=0, packing="padded")

    # two buttons on four cells: a model that ignores the screen clicks the target 1 time in 4
    # (1 in 2 if it only learned to click some button); the probe of the same recipe measured 100%
    # (seed 0), and this test passes with seed 1 too
    assert _success(model, processor, held_out) >= 0.8
