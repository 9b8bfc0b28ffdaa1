"""M-RoPE positions of weir's layouts against Hugging Face's own batch computation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from weir.data.vision import encode_vision_prompt
from weir.data.vision_model import vision_model
from weir.tasks.tiny_vlm import build_vlm_processor, tiny_vlm_config


@pytest.fixture(scope="module")
def parts():
    from transformers import AutoModelForImageTextToText

    processor = build_vlm_processor()
    model = AutoModelForImageTextToText.from_config(tiny_vlm_config(processor.tokenizer, "nano"))
    return model, processor


sizes = st.tuples(st.sampled_from([16, 32, 48, 64]), st.sampled_from([16, 32, 48]))
prompts = st.lists(
    st.tuples(
        st.text("abc xyz", min_size=1, max_size=12).filter(str.strip),  # blank prompts are bad rows
        st.lists(sizes, max_size=2),
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=15, deadline=None)
@given(prompts)
def test_padded_and_packed_positions_are_hf_positions(parts, batch):
    model, processor = parts
    vm = vision_model(model)
    enc = []
    for text, image_sizes in batch:
        row = {"prompt": text, "images": [Image.new("RGB", s, (9, 9, 9)) for s in image_sizes]}
        if not image_sizes:
            row.pop("images")
        enc.append(encode_vision_prompt(processor, row))
    seqs, visions = [ids for ids, _ in enc], [v for _, v in enc]
    width = max(map(len, seqs))
    kwargs, deltas = vm.padded_inputs(seqs, visions, width)
    # HF: the whole left-padded batch at once, padding marked by the attention mask
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    grids = [v.tensors["image_grid_thw"] for v in visions if v is not None]
    hf_pos, hf_delta = model.model.get_rope_index(
        ids,
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
        image_grid_thw=torch.cat(grids) if grids else None,
        attention_mask=mask,
    )
    real = mask.bool()
    assert torch.equal(kwargs["position_ids"][:, real], hf_pos[:, real])
    assert deltas == hf_delta.reshape(-1).tolist()
    packed = vm.packed_inputs(seqs, visions)["position_ids"][:, 0]
    assert torch.equal(packed[1:], hf_pos[:, real])  # rows in order, padding dropped
    assert packed[0].tolist() == [i for s in seqs for i in range(len(s))]
