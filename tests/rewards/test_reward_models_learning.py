"""A GRPO run rewarded only by a sequence-classification reward model learns arithmetic.

The reward model is a real ``Qwen3ForSequenceClassification`` directory with its own tokenizer and
chat template, constructed so that its score is known: its tokenizer is a word-level vocabulary of
the correct equations ``"a+b=c"`` of the task (anything else is ``[UNK]``), its chat template
renders prompt + response as ``"<prompt>=<response>"``, its blocks add nothing to the residual
stream (output projections zero), and its embeddings and score head give +1 to every equation token
and -1 to ``[UNK]``. So its logit is +1 exactly when the response is the right answer; the run maps
it to a reward of 1.1 / -0.1 (scale 0.6, shift 0.5), never seeing ``row["answer"]``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast, Qwen3Config

import weir
from weir.config import load_config
from weir.loop.evaluation import eval_config, run_eval

QUICK = str(Path(__file__).parents[2] / "examples" / "arithmetic_quick.yaml")


def build_equation_rm(out: Path, digits: int = 1) -> Path:
    """The constructed reward model of the module docstring, saved as a standard HF directory."""
    span = range(10**digits)
    vocab = {"[UNK]": 0, "[PAD]": 1}
    for a in span:
        for b in span:
            vocab[f"{a}+{b}={a + b}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    tokenizer.chat_template = "{{ messages[0]['content'] }}={{ messages[-1]['content'] }}"
    hidden = 16
    config = Qwen3Config(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_labels=1,
        pad_token_id=1,
        tie_word_embeddings=False,
    )
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.fill_(1.0)
        emb[0].fill_(-1.0)  # [UNK]
        emb[1].zero_()  # [PAD]
        # the final RMSNorm maps +-1 to +-1/sqrt(1 + eps): the head averages it back to +-1
        model.score.weight.fill_((1 + config.rms_norm_eps) ** 0.5 / hidden)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_equation_rm_scores_what_it_was_built_to(tmp_path):
    import asyncio

    from weir.data.sample import Sample
    from weir.rollout.rewards import get_reward, score

    path = build_equation_rm(tmp_path / "rm")
    fn = get_reward("reward_model", path=str(path), scale=0.6, shift=0.5)
    out = {}
    for response in ("7", "8", "7 7", "", "07"):
        s = Sample(prompt_ids=[1], response_ids=[5], response_text=response)
        asyncio.run(score(fn, s, {"prompt": "3+4"}))
        out[response] = round(s.reward, 4)
    assert out == {"7": 1.1, "8": -0.1, "7 7": -0.1, "": -0.1, "07": -0.1}


@pytest.mark.slow
def test_grpo_with_a_reward_model_learns_arithmetic(tmp_path):
    rm = build_equation_rm(tmp_path / "rm")
    sft_model = weir.sft(QUICK, [f"run.dir={tmp_path / 'sft'}", "telemetry.console=false"])
    result = weir.run(
        QUICK,
        [
            f"run.dir={tmp_path / 'rl'}",
            f"model.path={sft_model}",
            "run.steps=16",
            "reward.function=reward_model",
            f"reward.kwargs={{path: {rm}, scale: 0.6, shift: 0.5, batch_size: 64}}",
            "telemetry.console=false",
        ],
    )
    rewards = [h["reward/mean"] for h in result.history if "reward/mean" in h]
    assert len(rewards) == 16
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    # held-out accuracy by the task's own exact_match, independent of the reward model
    before = run_eval(
        load_config(
            QUICK,
            [
                f"model.path={sft_model}",
                "reward.function=exact_match",
                f"run.dir={tmp_path / 'ev'}",
            ],
        )
    )
    # what docs/reward-models.md advises: `weir eval RUN_DIR --reward exact_match`
    after = run_eval(eval_config(str(result.dir), reward="exact_match"))
    assert after["eval/accuracy"] > before["eval/accuracy"] + 0.15, (before, after)
    # the run's own greedy eval (reward >= 1 <=> the RM says correct) agrees
    assert result.evals[-1]["eval/accuracy"] > result.evals[0]["eval/accuracy"] + 0.15
