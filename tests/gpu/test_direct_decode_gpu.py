"""The engine's direct decode forward (weir.engine.decode) on CUDA: the same tokens as the HF
forward and log-probs within rounding, in float32 and bfloat16, and whether the first-step check
kept it on.

On CUDA the direct path may take another kernel than the HF forward (its query tensor has other
strides), so the engine accepts it within rounding (`weir.engine.decode.forwards_agree`): on an H200
in bfloat16 it was kept, with log-probs up to 1e-3 apart from the HF path's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from weir.config.devices import rounding_tolerance
from weir.engine import SamplingParams, TorchEngine

pytestmark = pytest.mark.gpu


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_decode_on_cuda_matches_the_hf_forward(tiny_model_dir, dtype):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).to("cuda").eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 262, (n,), generator=g).tolist() for n in (5, 17, 30, 9)]
    params = SamplingParams(n=4, max_new_tokens=32, temperature=1.0, seed=3)
    out, used = {}, {}
    for direct in (True, False):
        # CUDA graphs off: their whole-width attention differs by rounding (test_cuda_graphs_gpu)
        with TorchEngine(
            model, eos_token_ids=[1], pad_token_id=0, direct_decode=direct, cuda_graphs=False
        ) as e:
            out[direct] = e.generate_many(prompts, params)
            used[direct] = e.stats()["decode_direct"]
    assert used[False] == 0.0
    print(f"{dtype}: direct decode kept on CUDA: {bool(used[True])}")
    same, gaps = 0, []
    for a, b in zip(out[True], out[False], strict=True):
        for x, y in zip(a, b, strict=True):
            # a rounding difference may flip a near tie; compare up to the first differing token
            k = common_prefix(x.token_ids, y.token_ids)
            same += x.token_ids == y.token_ids
            gaps += [abs(s - t) for s, t in zip(x.logprobs[:k], y.logprobs[:k], strict=True)]
    assert same >= 0.9 * sum(len(a) for a in out[True])
    mean_gap = sum(gaps) / len(gaps)
    print(f"{dtype}: mean |log-prob difference| {mean_gap:.2e}, max {max(gaps):.2e}")
    assert mean_gap <= rounding_tolerance(dtype, torch.device("cuda"))
    assert max(gaps) <= 10 * rounding_tolerance(dtype, torch.device("cuda"))
