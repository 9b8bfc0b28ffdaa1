"""The real `openai` client drives the server over several turns; the recorded trajectory must be the
exact token sequence the engine conditioned on, with the log-probs the API returned."""

from __future__ import annotations

import openai
import pytest
import torch

from weir.data.sample import Status


def _client(session):
    return openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


def _enc(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _teacher_forced_logprobs(model, ids, temperature=1.0):
    """log p(ids[t] | ids[:t]) for t >= 1 by one full forward pass (independent of the engine)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float() / temperature
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def _stream(client, **kw):
    pieces, lps, finish, usage = [], [], None, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.logprobs and c.logprobs.content:
            lps += [x.logprob for x in c.logprobs.content]
        finish = c.finish_reason or finish
    return "".join(pieces), lps, finish, usage


def test_three_turns_streaming_and_not_give_one_token_exact_trajectory(server, model, tokenizer):
    session = server.sessions.open({"question": "1+1"})
    client = _client(session)
    eos = tokenizer.eos_token_id
    messages = [{"role": "user", "content": "what is 1+1?"}]

    r1 = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        logprobs=True,
        seed=11,
        extra_body={"return_token_ids": True},
    )
    c1 = r1.choices[0]
    ids1 = c1.token_ids
    lps1 = [x.logprob for x in c1.logprobs.content]
    assert len(ids1) == len(lps1) == r1.usage.completion_tokens
    assert c1.message.content == tokenizer.decode(ids1, skip_special_tokens=True)

    messages += [
        {"role": "assistant", "content": c1.message.content},
        {"role": "user", "content": "and 2+2?"},
    ]
    text2, lps2, finish2, usage2 = _stream(
        client,
        model="tiny",
        messages=messages,
        max_tokens=5,
        logprobs=True,
        seed=12,
        stream_options={"include_usage": True},
    )
    assert usage2.completion_tokens == len(lps2)

    messages += [
        {"role": "assistant", "content": text2},
        {"role": "user", "content": "ok"},
    ]
    r3 = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, logprobs=True, seed=13
    )
    lps3 = [x.logprob for x in r3.choices[0].logprobs.content]

    assert [t["link"] for t in session.summary()["turns"]] == ["start", "extend", "extend"]
    turns = session.turns
    sample = session.to_sample()
    assert sample.prompt_ids == _enc(tokenizer, "<|user|>what is 1+1?<|end|><|assistant|>")

    def closing(turn):  # the end-of-turn marker the model did not emit itself
        return "" if turn.response_ids[-1:] == [eos] else "<|end|>"

    x2 = _enc(tokenizer, closing(turns[0]) + "<|user|>and 2+2?<|end|><|assistant|>")
    x3 = _enc(tokenizer, closing(turns[1]) + "<|user|>ok<|end|><|assistant|>")
    r2_ids, r3_ids = turns[1].response_ids, turns[2].response_ids
    assert turns[0].response_ids == ids1
    assert text2 == tokenizer.decode(r2_ids, skip_special_tokens=True)
    assert sample.response_ids == ids1 + x2 + r2_ids + x3 + r3_ids
    assert sample.loss_mask == [1] * len(ids1) + [0] * len(x2) + [1] * len(r2_ids) + [0] * len(
        x3
    ) + [1] * len(r3_ids)
    expected_lp = lps1 + [0.0] * len(x2) + lps2 + [0.0] * len(x3) + lps3
    assert sample.rollout_logprobs == pytest.approx(expected_lp, abs=1e-6)
    assert sample.versions == [0 if m else -1 for m in sample.loss_mask]
    assert sample.status in (Status.COMPLETED, Status.TRUNCATED)

    # The engine really conditioned on this exact sequence: a teacher-forced pass over it reproduces
    # every sampled token's log-prob.
    full = sample.prompt_ids + sample.response_ids
    forced = _teacher_forced_logprobs(model, full)[len(sample.prompt_ids) - 1 :]
    sampled = [i for i, m in enumerate(sample.loss_mask) if m]
    assert [forced[i] for i in sampled] == pytest.approx(
        [sample.rollout_logprobs[i] for i in sampled], abs=2e-4
    )


def test_edited_history_starts_a_new_segment(server, tokenizer):
    session = server.sessions.open()
    client = _client(session)
    first = [{"role": "user", "content": "hello"}]
    r1 = client.chat.completions.create(model="tiny", messages=first, max_tokens=3)
    edited = [
        {"role": "user", "content": "HELLO"},
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "again"},
    ]
    client.chat.completions.create(model="tiny", messages=edited, max_tokens=3)
    client.chat.completions.create(model="tiny", messages=first, max_tokens=3)  # a retry

    links = [t["link"] for t in session.summary()["turns"]]
    assert links[0] == "start"
    assert links[1] == "new: message 0 differs from the recorded history"
    assert links[2] == "new: no new messages after the previous assistant turn"
    samples = session.to_samples()
    assert [s.metadata["segment"] for s in samples] == [0, 1, 2]
    second = samples[1]
    expected = tokenizer.apply_chat_template(edited, tokenize=False, add_generation_prompt=True)
    assert second.prompt_ids == _enc(tokenizer, expected)
    assert second.loss_mask == [1] * len(second.response_ids)


def test_completions_endpoint_links_text_continuations(server, tokenizer):
    session = server.sessions.open()
    client = _client(session)
    r1 = client.completions.create(model="tiny", prompt="12+30=", max_tokens=4, logprobs=1, seed=1)
    c1 = r1.choices[0]
    assert len(c1.logprobs.tokens) == len(c1.logprobs.token_logprobs) == r1.usage.completion_tokens
    assert c1.logprobs.text_offset[0] == 0

    prompt2 = "12+30=" + c1.text + "\n7+1="
    pieces, lps2 = [], []
    for chunk in client.completions.create(
        model="tiny", prompt=prompt2, max_tokens=3, logprobs=0, stream=True, seed=2
    ):
        pieces.append(chunk.choices[0].text)
        if chunk.choices[0].logprobs:
            lps2 += chunk.choices[0].logprobs.token_logprobs
    t1, t2 = session.turns
    assert t2.link == "extend"
    assert "".join(pieces) == tokenizer.decode(t2.response_ids, skip_special_tokens=True)
    sample = session.to_sample()
    added = _enc(tokenizer, "\n7+1=")
    assert sample.response_ids == t1.response_ids + added + t2.response_ids
    assert sample.rollout_logprobs == pytest.approx(
        c1.logprobs.token_logprobs + [0.0] * len(added) + lps2, abs=1e-6
    )


def test_models_endpoint(server):
    session = server.sessions.open()
    assert [m.id for m in _client(session).models.list().data] == ["tiny"]


def test_each_turn_records_the_weight_version_that_sampled_it(server, engine):
    session = server.sessions.open()
    client = _client(session)
    messages = [{"role": "user", "content": "v"}]
    before = engine.version
    try:
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        engine.update_weights_sync([], version=before + 5)  # new version, same weights
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "w"},
        ]
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    finally:
        engine.update_weights_sync([], version=before)
    t1, t2 = session.turns
    sample = session.to_sample()
    added = len(t2.prompt_ids) - len(t1.context)
    assert sample.versions == (
        [before] * len(t1.response_ids) + [-1] * added + [before + 5] * len(t2.response_ids)
    )
