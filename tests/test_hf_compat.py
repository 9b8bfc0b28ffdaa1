"""weir across the transformers releases it supports (pyproject: >=5.17, <5.40).

Marked `hf_compat`: `make test` also runs this subset under the oldest supported release
(tests/test_transformers_oldest.py, in .venv-tf-old), so that both ends of the range are tested.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, DynamicCache

from tests.hf_deprecations import deprecations_from_weir, weir_caller
from weir.hf_compat import cache_kwarg, cache_kwargs, is_checkpointing

pytestmark = pytest.mark.hf_compat

RENAMED = Version(transformers.__version__) >= Version("5.24")


def test_the_installed_release_is_in_the_supported_range():
    """pyproject's range holds the installed transformers; `make test-tf-old` runs this subset with
    WEIR_EXPECT_TRANSFORMERS=oldest, and then it is the range's lower end."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    spec = next(d for d in project["dependencies"] if d.startswith("transformers"))
    lower, upper = (
        Version(v) for v in re.fullmatch(r"transformers>=([\d.]+),<([\d.]+)", spec).groups()
    )
    installed = Version(transformers.__version__)
    assert lower <= installed < upper
    if os.environ.get("WEIR_EXPECT_TRANSFORMERS") == "oldest":
        assert installed.release[:2] == lower.release[:2], (installed, lower)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def test_the_cache_goes_under_the_name_the_release_takes(model):
    """5.24 renamed the forward's `past_key_values` to `cache`; 5.17-5.23 would take `cache` into
    **kwargs and run without it. The name weir passes is the one the forward declares, and the cache
    it passes is the one the forward fills: a second forward over one more token, on that cache,
    gives the logits of the whole sequence's forward."""
    assert cache_kwarg(model) == ("cache" if RENAMED else "past_key_values")
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        whole = model(input_ids=ids).logits[:, -1]
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :-1], use_cache=True, **cache_kwargs(model, cache))
        assert cache.get_seq_length() == 4
        step = model(input_ids=ids[:, -1:], use_cache=True, **cache_kwargs(model, cache)).logits
    torch.testing.assert_close(step[:, -1], whole, rtol=0, atol=1e-5)


def test_a_forward_that_declares_only_past_key_values_gets_that_name():
    """A remote-code model written for older releases keeps `past_key_values` on any release."""

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return past_key_values

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            return cache

    class Wrapper(torch.nn.Module):  # peft's shape: forward(*args, **kwargs) around a base model
        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_model(self):
            return self.base

        def forward(self, *args, **kwargs):
            return self.base(*args, **kwargs)

    assert cache_kwarg(Old()) == "past_key_values"
    assert cache_kwarg(New()) == "cache"
    assert Old()(**cache_kwargs(Old(), "kv")) == "kv"
    assert Wrapper(Old())(**cache_kwargs(Wrapper(Old()), "kv")) == "kv"


def test_checkpointing_is_switched_on_and_read_without_deprecated_calls(tiny_model_dir):
    """`prepare_for_training` switches activation checkpointing on, and `is_checkpointing` reads it
    (and the prefix layout refuses it), with no deprecated transformers call on the way."""
    from weir.train.modes import prepare_for_training
    from weir.train.packing import prefix_refused_unprobed

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        assert not is_checkpointing(model)
        assert prefix_refused_unprobed(model) is None
        prepare_for_training(model, checkpointing=True)
        assert is_checkpointing(model)
        assert "gradient checkpointing" in prefix_refused_unprobed(model)


def _deprecated_call():
    """A transformers function with a deprecated keyword, as transformers declares them."""
    from transformers.utils.deprecation import deprecate_kwarg

    @deprecate_kwarg("old", version="99.0", new_name="new")
    def fn(new=None):
        return new

    return fn


def test_the_guard_catches_weir_calls_only():
    """tests/hf_deprecations.py: a deprecated transformers call made from a weir module is recorded
    (so the test making it fails), the same call made by another package is not."""
    fn = _deprecated_call()
    scope = {"fn": fn}
    exec(compile("def call():\n    return fn(old=1)\n", "weir_module.py", "exec"), scope)
    scope["__name__"] = "weir.fake"
    weir_call = type(scope["call"])(scope["call"].__code__, scope)
    other = {"fn": fn, "__name__": "peft.tuners"}
    exec(compile("def call():\n    return fn(old=1)\n", "peft_module.py", "exec"), other)
    with warnings.catch_warnings(), deprecations_from_weir() as found:
        warnings.simplefilter("ignore")  # recorded even where a filter hides it
        assert weir_call() == 1
        assert other["call"]() == 1
    assert len(found) == 1 and "weir_module.py" in found[0] and "FutureWarning" in found[0]
    assert weir_caller(None) is None


def test_weir_forwards_raise_no_transformers_deprecation(model, tiny_model_dir):
    """The engine's prefill and decode, the KV-cell measurement and the trainer's prefix layout,
    on the installed release, warn of nothing deprecated (with `past_key_values` on 5.24 each
    forward warned, and 5.40 drops it)."""
    from weir.engine.base import SamplingParams
    from weir.engine.kv_budget import measure_cell_bytes
    from weir.engine.torch_engine import TorchEngine
    from weir.train.packing import prefix_refused_unprobed
    from weir.train.prefix_pass import prefix_response_logprobs

    with deprecations_from_weir() as found:
        with TorchEngine(model, eos_token_ids=[1], pad_token_id=0, seed=0) as engine:
            out = engine.generate_many([[3, 5, 7]], SamplingParams(n=2, max_new_tokens=4))
        assert all(len(c.token_ids) >= 1 for c in out[0])
        assert measure_cell_bytes(model) > 0
        seqs = [[3, 5, 7, 9, 11], [3, 5, 7, 13]]
        got = prefix_response_logprobs(model, seqs, [2, 1])
        assert got.logprobs.shape[0] == 2
        assert prefix_refused_unprobed(model) is None
    assert found == []
