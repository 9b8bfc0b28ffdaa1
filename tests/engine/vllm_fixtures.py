"""Shared set-up of the vLLM tests: the .venv-vllm interpreter (or a skip that says why, never in CI),
a tiny model saved as an HF directory, and references from plain full-sequence forward passes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def vllm_python() -> str:
    """The vLLM environment's Python (``$WEIR_VLLM_PYTHON``, else .venv-vllm); in CI its absence
    fails the test instead of skipping it."""
    if os.environ.get("WEIR_VLLM_PYTHON"):
        return os.environ["WEIR_VLLM_PYTHON"]
    if VLLM_PYTHON.exists():
        return str(VLLM_PYTHON)
    reason = f"no vLLM environment at {VLLM_PYTHON}: run `make setup-vllm`"
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI builds it in `make test`; it must not be skipped there)")
    pytest.skip(reason)


@torch.inference_mode()
def trainer_logprobs(
    model, prompt: list[int], tokens: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T)[token] of each of `tokens` from one full forward (T = 1 if greedy)."""
    t = temperature if temperature > 0 else 1.0
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0].float()[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
