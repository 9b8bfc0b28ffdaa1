"""Every architecture weir claims (docs/models.md), small and random: the engine's log-probs equal a
plain full HF forward past the sliding window (prefill, decode, and the KV recompute after a weight
update), packed equals unpacked (or the self-check falls back to padded rows), and the refused
configurations get a one-line error."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from weir.engine import SamplingParams, TorchEngine
from weir.engine.support import ModelSupport, UnsupportedModel, model_support
from weir.loop.selfcheck import run_selfcheck
from weir.tasks.tiny_archs import ARCHS, WINDOW, arch_config, build_arch_model
from weir.train.packing import packed_response_logprobs, padded_response_logprobs

NAMES = sorted(ARCHS)
SLIDING = {"qwen2", "mistral", "phi3_window", "gemma2", "gemma3", "gpt_oss"}
NO_PACKING = {"gpt_oss"}
TOL = 1e-5
PAD = 0


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    """name -> (model directory, model), built once per module."""
    root = tmp_path_factory.mktemp("archs")
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            path = build_arch_model(root / name, name, seed=0)
            cache[name] = (path, AutoModelForCausalLM.from_pretrained(path).eval())
        return cache[name]

    return get


def _prompts(n: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 262, (k,), generator=g).tolist() for k in lengths[:n]]


@torch.inference_mode()
def _reference(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(tokens | prompt) from one plain forward of the whole sequence (no mask passed)."""
    logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], -1)
    return lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def _engine(model) -> TorchEngine:
    return TorchEngine(model, eos_token_ids=[], pad_token_id=PAD, seed=0, num_threads=1)


def _max_err(model, prompts, results) -> float:
    errs = []
    for prompt, comps in zip(prompts, results, strict=True):
        for c in comps:
            assert len(c.token_ids) > 0
            ref = _reference(model, prompt, list(c.token_ids))
            errs.append((ref - torch.tensor(c.logprobs)).abs().max().item())
    return max(errs)


@pytest.mark.parametrize("name", NAMES)
def test_engine_equals_full_forward_past_the_window(arch_models, name):
    _, model = arch_models(name)
    support = model_support(model.config)
    assert bool(support.sliding_windows()) == (name in SLIDING)
    # prompts of different lengths (left padding), 3 samples each, decoding to 3-4 windows long
    prompts = _prompts(3, [5, 13, 21], seed=1)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=3 * WINDOW, seed=7)
    with _engine(model) as engine:
        results = engine.generate_many(prompts, params)
        assert _max_err(model, prompts, results) <= TOL
        if name in SLIDING:
            # the same engine without the window is visibly off: the check has power
            engine._support = ModelSupport(
                support.model_type, support.name, dict.fromkeys(support.windows), True
            )
            wrong = engine.generate_many(prompts, params)
            assert _max_err(model, prompts, wrong) > 0.05


@pytest.mark.parametrize("name", sorted(SLIDING | {"qwen3_moe", "deepseek_v3"}))
def test_kv_recompute_after_weight_update_is_exact(arch_models, name):
    """A request in flight across a weight update: its later tokens are the new policy's, on the
    full context, past the window (the KV recompute goes through the same per-layer masks)."""
    _, base = arch_models(name)
    model = copy.deepcopy(base)
    new = {
        k: v + 0.02 * torch.randn_like(v)
        for k, v in model.state_dict().items()
        if v.is_floating_point()
    }
    prompt = _prompts(1, [11], seed=3)[0]
    with _engine(model) as engine:
        reached = threading.Event()
        decode = engine._decode_step

        def decode_then_pause() -> None:  # the loop stops after exactly WINDOW + 2 decode steps
            decode()
            if engine.stats()["decode_steps"] == WINDOW + 2:
                with engine._mu:
                    engine._paused = True
                reached.set()

        engine._decode_step = decode_then_pause
        params = SamplingParams(temperature=0.0, max_new_tokens=4 * WINDOW, seed=0)
        fut = engine.submit(prompt, params)
        assert reached.wait(60)
        engine.update_weights_sync(new.items(), version=1)
        engine.resume_sync()
        comp = fut.result()[0]
    split = comp.versions.index(1)
    assert split == WINDOW + 3 < len(comp.token_ids)  # prefill token + WINDOW + 2 decode steps
    toks = list(comp.token_ids)
    ref = _reference(model, prompt, toks)  # model now holds the new weights
    err = (ref[split:] - torch.tensor(comp.logprobs[split:])).abs().max().item()
    assert err <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_selfcheck_packed_or_falls_back(arch_models, name):
    """The start-up self-check on the actual model: packed = unpacked, engine = trainer; GPT-OSS keeps
    packed sequences together, so the run falls back to padded rows, which are exact."""
    _, model = arch_models(name)

    class Train:
        packing = "auto"

    train = Train()
    with _engine(model) as engine:
        result = run_selfcheck(model, engine, train)
    assert result.engine_err <= TOL
    if name in NO_PACKING:
        assert result.packed_err > 0.05 and train.packing == "padded" == result.packing
    else:
        assert result.packed_err <= TOL and train.packing == "auto"
    assert result.seconds < 5.0

    seqs = _prompts(3, [30, 9, 17], seed=5)
    lens = [len(s) - 1 for s in seqs]
    with torch.no_grad():
        padded = padded_response_logprobs(model, seqs, lens).logprobs
        for i, s in enumerate(seqs):
            ref = _reference(model, s[:1], s[1:])
            assert (padded[i, : lens[i]] - ref).abs().max().item() <= TOL
            if name not in NO_PACKING:
                packed = packed_response_logprobs(model, seqs, lens).logprobs
                assert (packed[i, : lens[i]] - ref).abs().max().item() <= TOL


def test_explicit_packing_on_a_model_that_breaks_it_stops(arch_models):
    _, model = arch_models("gpt_oss")

    class Train:
        packing = "packed"

    with _engine(model) as engine, pytest.raises(UnsupportedModel) as err:
        run_selfcheck(model, engine, Train())
    msg = str(err.value)
    assert "\n" not in msg and "GPT-OSS" in msg and "train.packing=padded" in msg


@pytest.mark.parametrize(
    ("name", "overrides", "feature"),
    [
        ("gemma3", dict(use_bidirectional_attention=True), "bidirectional attention"),
        (
            "mistral",
            dict(layer_types=["sliding_attention", "full_attention"]),
            "per-layer attention",
        ),
    ],
)
def test_refused_configurations_name_the_feature(name, overrides, feature):
    config = arch_config(name, **overrides)
    with pytest.raises(UnsupportedModel) as err:
        model_support(config)
    msg = str(err.value)
    assert "\n" not in msg and feature in msg and config.model_type in msg


def test_refused_architecture_and_sdpa_softcapping():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModel, match="'gpt2'"):
        model_support(GPT2Config())
    config = arch_config("gemma2")
    config._attn_implementation = "sdpa"
    with pytest.raises(UnsupportedModel, match="soft-capping.*attn_implementation='eager'"):
        model_support(config)


@pytest.mark.parametrize(
    ("config_fn", "needle"),
    [
        (
            lambda: __import__("transformers").GPT2Config(
                n_layer=1, n_embd=16, n_head=2, bos_token_id=1, eos_token_id=1
            ),
            "'gpt2'",
        ),
        (lambda: arch_config("gemma3", use_bidirectional_attention=True), "bidirectional"),
    ],
)
def test_weir_train_refuses_with_one_line(tmp_path, config_fn, needle):
    """`weir train` on a refused model: exit 1 and one line naming the feature and architecture,
    before any engine or trainer is built (no traceback)."""
    from typer.testing import CliRunner

    from weir.cli.main import app
    from weir.tasks.tiny_model import build_tokenizer

    config = config_fn()
    config.vocab_size = len(build_tokenizer())
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    build_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "run.yaml").write_text("run: {steps: 1}\n")
    res = CliRunner().invoke(
        app,
        [
            "train",
            str(tmp_path / "run.yaml"),
            f"model.path={tmp_path / 'model'}",
            f"run.dir={tmp_path / 'run'}",
        ],
        env={"COLUMNS": "400"},
    )
    assert res.exit_code == 1, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "unsupported model" in lines[0] and needle in lines[0], res.output
    assert "Traceback" not in res.output


def test_sft_on_a_model_that_breaks_packing_trains_unpacked(arch_models, tmp_path, capsys):
    """`weir sft` runs the packing probe too: GPT-OSS is trained one padded row per sequence, and
    the loss it logs is the unpacked one."""
    import json

    import weir

    path, _ = arch_models("gpt_oss")
    cfg = {
        "model": {"path": str(path), "threads": 1},
        "sft": {"rows": 8, "batch_size": 8, "epochs": 1, "warmup_steps": 0},
        "telemetry": {"console": False},
    }
    from transformers import AutoTokenizer

    from weir.config import build_config
    from weir.loop.sft import sft_examples

    # expected first-step loss: -mean log p(response | prompt), one plain forward per example
    tokenizer = AutoTokenizer.from_pretrained(path)
    examples, _ = sft_examples(build_config(cfg), tokenizer, tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    lps = [_reference(model, p, r) for p, r in examples]
    expected = -torch.cat(lps).mean().item()

    out = weir.sft(cfg, [f"run.dir={tmp_path / 'sft'}", "run.deterministic=true"])
    assert "training with train.packing=padded instead" in capsys.readouterr().err
    assert (out / "config.json").exists()
    record = json.loads((tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1
    assert abs(record["sft/loss"] - expected) < 1e-4
