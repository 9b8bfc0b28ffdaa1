from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from weir.train.model import load_model, save_model
from weir.train.packing import pack_by_tokens, packed_response_logprobs


def test_tiny_model_round_trip(tiny_model_dir, tmp_path):
    model, tok = load_model(str(tiny_model_dir))
    out = save_model(model, tok, tmp_path / "copy")
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    again = AutoModelForCausalLM.from_pretrained(out)
    tok2 = AutoTokenizer.from_pretrained(out)
    for (n1, p1), (n2, p2) in zip(
        model.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2)
    text = tok2.apply_chat_template(
        [{"role": "user", "content": "12+34"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|user|>12+34<|end|><|assistant|>"
    assert tok2.decode(tok2("héllo 42", add_special_tokens=False)["input_ids"]) == "héllo 42"


def test_pack_by_tokens_respects_budget_and_covers_all():
    lengths = [5, 9, 3, 7, 2, 8, 1]
    bins = pack_by_tokens(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert pack_by_tokens([12, 3], 10) == [[0], [1]]


def test_packed_logprobs_equal_unpacked_forward(tiny_model_dir):
    """Packing must isolate sequences: each packed log-prob equals a forward pass on that sequence alone."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(6, 200, (n,), generator=g).tolist() for n in (7, 12, 5)]
    resp = [3, 6, 2]
    with torch.no_grad():
        packed = packed_response_logprobs(model, seqs, resp, temperature=0.7).logprobs
        for i, (s, r) in enumerate(zip(seqs, resp, strict=True)):
            logits = model(torch.tensor([s])).logits[0].float() / 0.7
            expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(s[1:])[:, None])[
                :, 0
            ][-r:]
            assert torch.allclose(packed[i, :r], expected, atol=1e-5)
            assert torch.all(packed[i, r:] == 0)
