"""`agent_rollout`: an agent written against the `openai` client becomes a weir rollout function."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
import torch

from weir.data.sample import Status
from weir.engine.base import SamplingParams
from weir.rollout.collect import collect_groups
from weir.rollout.single_turn import RolloutContext
from weir.serve import agent_rollout


def _ctx(engine, tokenizer, reward_fn=None, n=2, temperature=0.7, max_new_tokens=4):
    return RolloutContext(
        engine=engine,
        tokenizer=tokenizer,
        sampling=SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens),
        reward_fn=reward_fn or (lambda sample, row: -1.0),
        encode=lambda row: tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}],
                tokenize=False,
                add_generation_prompt=True,
            ),
            add_special_tokens=False,
        )["input_ids"],
    )


def _post_reward(base_url, api_key, reward):
    req = urllib.request.Request(
        base_url + "/sessions/current/reward",
        data=json.dumps({"reward": reward, "info": {"by": "agent"}}).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=30).close()


def test_sync_agent_two_turns_with_http_reward(engine, tokenizer, model):
    rewards = {}

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": row["prompt"]}]
        # The agent asks for other settings; the session enforces the run's (T=0.7, <= 4 tokens).
        r = client.chat.completions.create(
            model="any", messages=messages, temperature=1.0, max_tokens=50
        )
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "sure?"},
        ]
        client.chat.completions.create(model="any", messages=messages, max_tokens=50)
        rewards[api_key] = float(len(rewards))
        _post_reward(base_url, api_key, rewards[api_key])

    ctx = _ctx(engine, tokenizer, n=2)
    rows = [{"prompt": "1+1="}, {"prompt": "2+5="}]
    fn = agent_rollout(agent)
    for _ in range(2):  # every collect_groups call runs its own event loop
        groups, metrics = collect_groups(ctx, rows, fn)
        assert len(groups) == 2 and metrics["rollout/failed"] == 0
        for g in groups:
            assert len(g) == 2
            for s in g:
                assert s.status in (Status.COMPLETED, Status.TRUNCATED)
                assert s.reward_info == {"by": "agent"}
                assert s.metadata["turns"] == 2
                runs = _runs(s.loss_mask)
                assert [m for m, _ in runs] == [1, 0, 1]
                assert all(n <= 4 for m, n in runs if m == 1)
                full = torch.tensor([s.prompt_ids + s.response_ids])
                with torch.no_grad():
                    logits = model(full).logits[0, :-1] / 0.7
                lp = torch.log_softmax(logits, -1).gather(1, full[0, 1:, None])[:, 0]
                lp = lp[len(s.prompt_ids) - 1 :].tolist()
                sampled = [i for i, m in enumerate(s.loss_mask) if m]
                assert [lp[i] for i in sampled] == pytest.approx(
                    [s.rollout_logprobs[i] for i in sampled], abs=2e-4
                )
    assert sorted(s.reward for g in groups for s in g) == [4.0, 5.0, 6.0, 7.0]


def _runs(mask):
    out = []
    for m in mask:
        if out and out[-1][0] == m:
            out[-1][1] += 1
        else:
            out.append([m, 1])
    return [tuple(r) for r in out]


async def _async_agent(base_url, api_key, row):
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": row["prompt"]}]
        )
    return 2.5


def test_async_agent_returned_reward_and_reward_function_fallback(engine, tokenizer):
    ctx = _ctx(engine, tokenizer, n=2)
    groups, _ = collect_groups(ctx, [{"prompt": "3+3="}], agent_rollout(_async_agent))
    assert [s.reward for s in groups[0]] == [2.5, 2.5]
    assert groups[0].samples[0].prompt_ids == ctx.encode({"prompt": "3+3="})

    def silent(base_url, api_key, row):
        openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).completions.create(
            model="any", prompt=row["prompt"]
        )

    def reward_fn(sample, row):
        return (
            0.25
            if sample.response_text
            == tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            else 0.0
        )

    ctx = _ctx(engine, tokenizer, reward_fn=reward_fn, n=1)
    groups, _ = collect_groups(ctx, [{"prompt": "3+3="}], agent_rollout(silent))
    assert [s.reward for s in groups[0]] == [0.25]


def test_failing_agents_give_failed_samples(engine, tokenizer):
    def boom(base_url, api_key, row):
        openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
            model="any", messages=[{"role": "user", "content": "x"}]
        )
        raise RuntimeError("tool crashed")

    def idle(base_url, api_key, row):
        return 1.0

    ctx = _ctx(engine, tokenizer, n=2)
    rows = [{"prompt": "a"}]
    groups, metrics = collect_groups(ctx, rows, agent_rollout(boom))
    assert metrics["rollout/failed"] == 2
    for s in groups[0]:
        assert s.status == Status.FAILED and s.reward is None
        assert s.error == "AgentError: RuntimeError: tool crashed"
        assert len(s.response_ids) > 0  # the recording is kept for inspection
    groups, _ = collect_groups(ctx, rows, agent_rollout(idle))
    assert [s.error for s in groups[0]] == ["AgentError: the agent made no model call"] * 2

    def slow(base_url, api_key, row):
        import time

        time.sleep(1.0)
        openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).models.list()

    groups, _ = collect_groups(ctx, rows, agent_rollout(slow, timeout_s=0.2))
    assert all("timeout" in s.error for s in groups[0])


def test_a_closed_engines_server_is_stopped_on_the_next_rollout(model, tokenizer):
    from weir.engine.torch_engine import TorchEngine
    from weir.serve.agent import server_for, stop_servers

    first = TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=0)
    old = server_for(first, tokenizer)
    assert old.running
    assert server_for(first, tokenizer) is old  # one server per engine
    first.close()
    second = TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=0)
    try:
        new = server_for(second, tokenizer)
        assert new is not old and new.running and not old.running
        assert openai.OpenAI(base_url=new.base_url, api_key=new.sessions.admin_key).models.list()
    finally:
        stop_servers()
        second.close()


def test_a_seeded_rollout_is_reproducible_and_its_sessions_differ(engine, tokenizer):
    def two_turns(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": row["prompt"]}]
        r = client.chat.completions.create(model="any", messages=messages)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "again"},
        ]
        client.chat.completions.create(model="any", messages=messages)
        return 0.0

    ctx = _ctx(engine, tokenizer, n=3, temperature=1.0, max_new_tokens=6)
    ctx = ctx.with_sampling(seed=5)
    rows = [{"prompt": "1+2=", "_index": 0}, {"prompt": "1+2=", "_index": 1}]
    runs = []
    for _ in range(2):
        groups, _ = collect_groups(ctx, rows, agent_rollout(two_turns))
        runs.append([[s.response_ids for s in g] for g in groups])
    assert runs[0] == runs[1]
    flat = [ids for g in runs[0] for ids in g]
    assert len({tuple(ids) for ids in flat}) == len(flat)  # 6 sessions, 6 different episodes
