"""Reference computations for the engine tests: plain full-sequence forward passes."""

from __future__ import annotations

import time

import torch

from weir.engine import TorchEngine

EOS = 1
PAD = 0
TOL = 1e-5


def perturbed(model, seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """`model`'s parameters each moved by `scale` standard normal noise (seeded): new weights for
    an update, the model itself left as it is."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: p.detach() + scale * torch.randn(p.shape, generator=g)
        for name, p in model.named_parameters()
    }


def make_prompts(count: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [torch.randint(6, 262, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def full_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits predicting each of `tokens` (float32 [len(tokens), vocab], on the CPU) from one plain
    forward on the model's device."""
    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    logits = model(ids).logits[0].float().cpu()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def ref_logprobs(model, prompt, tokens, temperature: float = 1.0) -> torch.Tensor:
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(full_logits(model, prompt, tokens) / t, -1)
    return lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def assert_parity(model, prompt, completion, temperature: float = 1.0, tol: float = TOL) -> None:
    assert len(completion.token_ids) == len(completion.logprobs) == len(completion.versions)
    if not completion.token_ids:
        return
    ref = ref_logprobs(model, prompt, completion.token_ids, temperature)
    got = torch.tensor(completion.logprobs)
    err = (ref - got).abs().max().item()
    assert err <= tol, f"log-prob mismatch {err:.3g} > {tol}"


@torch.inference_mode()
def greedy_reference(model, prompt: list[int], max_new: int, eos: int | None = EOS) -> list[int]:
    out: list[int] = []
    for _ in range(max_new):
        logits = model(torch.tensor([prompt + out])).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        if tok == eos:
            break
    return out


def wait_steps(engine: TorchEngine, steps: int, timeout: float = 20.0) -> None:
    """Block until the engine has run `steps` more decode steps."""
    target = engine.stats()["decode_steps"] + steps
    deadline = time.monotonic() + timeout
    while engine.stats()["decode_steps"] < target:
        if time.monotonic() > deadline:
            raise TimeoutError("engine made no progress")
        time.sleep(0.001)
