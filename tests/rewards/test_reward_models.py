"""The sequence-classification reward model: its own template and tokenizer, scores equal to an
independent unpadded forward, batched == unbatched, the micro-batcher, and up-front refusals."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForSequenceClassification

from weir.config import Config
from weir.data.sample import Sample, Status
from weir.loop.components import reward_function
from weir.rollout.reward_models import MicroBatcher, RewardModel, _instance
from weir.rollout.rewards import get_reward, score
from weir.tasks.tiny_model import build_tokenizer, tiny_config

RM_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[score]"


def build_rm(path, num_labels: int = 1, seed: int = 0):
    """A nano Qwen3 sequence classifier with weir's tokenizer and its own chat template, whose
    score head is set by hand."""
    tok = build_tokenizer()
    tok.chat_template = RM_TEMPLATE
    cfg = tiny_config(tok, size="nano")
    cfg.num_labels = num_labels
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(cfg)
    with torch.no_grad():
        model.score.weight.copy_(
            torch.linspace(-1, 1, model.score.weight.numel()).view_as(model.score.weight)
        )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model.eval(), tok


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm") / "rm"
    model, tok = build_rm(path)
    return str(path), model, tok


def expected_logit(model, tok, prompt: str, response: str) -> float:
    """The head applied to the last hidden state of one unpadded sequence, by hand."""
    text = f"[user] {prompt}\n[assistant] {response}\n[score]"
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state[0, -1]
        return float(h @ model.score.weight[0])


def S(text: str) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[5], response_text=text)


CASES = [("3+4", "7"), ("12+30", "42"), ("9+9", "a much longer wrong answer: 17"), ("1+1", "")]


def test_renders_through_the_rms_own_template(rm):
    path, _, _ = rm
    r = _instance(
        path, device="cpu", dtype="float32", max_length=1024, batch_size=16, max_wait_ms=5.0
    )
    assert r.render("3+4", "7") == "[user] 3+4\n[assistant] 7\n[score]"
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]
    assert r.render(msgs, "a") == "[system] sys\n[user] q\n[assistant] a\n[score]"


def test_scores_match_an_independent_forward_and_batching_changes_nothing(rm):
    path, model, tok = rm
    want = [expected_logit(model, tok, p, r) for p, r in CASES]
    assert len({round(w, 4) for w in want}) == len(
        want
    )  # distinct, so the test can tell them apart

    async def concurrent():
        samples = [S(r + "<|end|>") for _, r in CASES]
        await asyncio.gather(
            *(score(fn, s, {"prompt": p}) for s, (p, _) in zip(samples, CASES, strict=True))
        )
        return samples

    fn = get_reward("reward_model", path=path, batch_size=8, max_wait_ms=200)
    batched = asyncio.run(concurrent())
    rm_obj = _instance(
        path, device="cpu", dtype="float32", max_length=1024, batch_size=8, max_wait_ms=200
    )
    assert rm_obj.batcher.batch_sizes[-1] == len(CASES)  # one padded forward for all of them
    one = get_reward("reward_model", path=path, batch_size=1)
    unbatched = []
    for p, r in CASES:
        s = S(r)
        asyncio.run(score(one, s, {"prompt": p}))
        unbatched.append(s)
    for s_b, s_u, w in zip(batched, unbatched, want, strict=True):
        assert s_b.status == s_u.status == Status.COMPLETED
        assert s_b.reward == pytest.approx(w, abs=1e-4)
        assert s_u.reward == pytest.approx(w, abs=1e-4)
        assert s_b.reward_info["rm_logit"] == pytest.approx(w, abs=1e-4)


def test_sigmoid_scale_shift(rm):
    path, model, tok = rm
    logit = expected_logit(model, tok, "3+4", "7")
    fn = get_reward("reward_model", path=path, sigmoid=True, scale=2.0, shift=-1.0)
    s = S("7")
    asyncio.run(score(fn, s, {"prompt": "3+4"}))
    assert s.reward == pytest.approx(2.0 / (1.0 + math.exp(-logit)) - 1.0, abs=1e-4)


def test_missing_prompt_field_fails_the_sample(rm):
    path, _, _ = rm
    s = S("7")
    asyncio.run(score(get_reward("reward_model", path=path), s, {"question": "3+4"}))
    assert s.status == Status.FAILED and "no prompt field 'prompt'" in s.error


def test_unusable_reward_models_are_refused_at_build(tmp_path):
    build_rm(tmp_path / "two", num_labels=2)
    for kwargs, message in (
        ({"path": str(tmp_path / "two")}, "has 2 labels"),
        ({"path": str(tmp_path / "nowhere")}, "cannot read its config"),
        ({}, "needs kwargs.path"),
        ({"path": str(tmp_path / "two"), "batchsize": 4}, "batchsize"),
        ({"path": str(tmp_path / "two"), "dtype": "bf16"}, "dtype 'bf16' is not one of"),
        ({"path": str(tmp_path / "two"), "device": "gpu0"}, "device 'gpu0' is not a torch device"),
    ):
        cfg = Config.model_validate({"reward": {"function": "reward_model", "kwargs": kwargs}})
        with pytest.raises(ValueError, match=message) as err:
            reward_function(cfg)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="has 2 labels"):
        RewardModel(str(tmp_path / "two"))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 25), max_batch=st.integers(1, 8))
def test_micro_batcher_keeps_order_and_bounds(n, max_batch):
    calls = []

    def double(items):
        calls.append(list(items))
        return [2 * x for x in items]

    batcher = MicroBatcher(double, max_batch=max_batch, max_wait_s=0.01)

    async def main():
        return await asyncio.gather(*(batcher.submit(i) for i in range(n)))

    assert asyncio.run(main()) == [2 * i for i in range(n)]
    assert all(1 <= len(c) <= max_batch for c in calls)
    assert sorted(x for c in calls for x in c) == list(range(n))
    # all n arrive before the first timer fires: full batches, then the remainder
    assert [len(c) for c in calls] == [max_batch] * (n // max_batch) + (
        [n % max_batch] if n % max_batch else []
    )


def test_micro_batcher_error_reaches_every_caller_and_a_new_loop_works():
    def broken(items):
        raise RuntimeError("forward failed")

    batcher = MicroBatcher(broken, max_batch=4, max_wait_s=0.01)

    async def main():
        return await asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True)

    results = asyncio.run(main())
    assert [type(r) for r in results] == [RuntimeError] * 3
    batcher.batch_fn = lambda items: [x + 1 for x in items]
    assert asyncio.run(main()) == [1, 2, 3]  # a second asyncio.run: fresh queue on the new loop


def test_the_configured_reward_pickles_without_its_model(rm):
    """What cluster.reward_workers ships to each Ray reward actor: the function and its options,
    not the loaded model (each process loads its own copy once)."""
    import pickle

    path, model, tok = rm
    fn = get_reward("reward_model", path=path, batch_size=4)
    blob = pickle.dumps(fn)
    assert len(blob) < 2000  # the nano model's weights alone are ~500 kB
    s = S("7")
    asyncio.run(score(pickle.loads(blob), s, {"prompt": "3+4"}))
    assert s.reward == pytest.approx(expected_logit(model, tok, "3+4", "7"), abs=1e-4)


def test_micro_batcher_serves_two_event_loops_at_once():
    """The async driver scores on its rollout loop while evaluation runs on another."""
    import threading

    batcher = MicroBatcher(lambda items: [x * 10 for x in items], max_batch=64, max_wait_s=0.05)
    results = {}

    def in_thread(base):
        async def main():
            return await asyncio.gather(*(batcher.submit(base + i) for i in range(5)))

        results[base] = asyncio.run(main())

    threads = [threading.Thread(target=in_thread, args=(b,)) for b in (0, 100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == {0: [0, 10, 20, 30, 40], 100: [1000, 1010, 1020, 1030, 1040]}
