"""Multi-agent episodes: per-role views, token-exact; credit; per-role groups, advantages, metrics."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from weir import algo
from weir.config import ConfigError, build_config
from weir.config.schema import MultiAgentConfig
from weir.data.prompts import encode_prompt
from weir.data.sample import Group, Sample, Status
from weir.engine.base import Completion, SamplingParams
from weir.rollout.collect import summarize
from weir.rollout.evaluate import evaluate
from weir.rollout.multi_agent import rollout
from weir.rollout.roles import Outcome, credit, parse_outcome
from weir.rollout.single_turn import RolloutContext
from weir.tasks import proposer_checker
from weir.tasks.tiny_model import build_tokenizer
from weir.train.batch import make_batch

TOK = build_tokenizer()
ROW = {"prompt": "3+4", "answer": "7"}


def ids_of(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def chat_ids(messages: list[dict]) -> list[int]:
    return ids_of(TOK.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


class RoleEngine:
    """Answers by role: the reply is `replies[role][k]` for the k-th call of that role (the role is
    read from the system message of the prompt). Records prompts; log-prob of token t = -(t+1)/10."""

    def __init__(self, replies: dict[str, list[str]], finish: str = "stop") -> None:
        self.replies, self.finish = replies, finish
        self.calls: dict[str, int] = dict.fromkeys(replies, 0)
        self.prompts: list[tuple[str, list[int]]] = []

    async def generate(self, prompt_ids, params: SamplingParams) -> list[Completion]:
        text = TOK.decode(prompt_ids)
        role = next(r for r in self.replies if f"<|system|>{r}<|end|>" in text)
        k = self.calls[role]
        self.calls[role] += 1
        self.prompts.append((role, list(prompt_ids)))
        ids = ids_of(self.replies[role][min(k, len(self.replies[role]) - 1)])
        ids = [*ids, TOK.eos_token_id] if self.finish == "stop" else ids
        await asyncio.sleep(0)
        return [
            Completion(ids, [-(t + 1) / 10 for t in range(len(ids))], [3] * len(ids), self.finish)
        ]


def ctx_for(engine, ma: MultiAgentConfig, n: int = 1, reward=None, scorer=None) -> RolloutContext:
    extras = {"multi_agent": ma, "prompt": {"prompt_key": "prompt"}}
    if scorer is not None:
        extras["multi_agent_scorer"] = scorer
    return RolloutContext(
        engine=engine,
        tokenizer=TOK,
        sampling=SamplingParams(n=n, max_new_tokens=16),
        reward_fn=reward or (lambda s, row: float(s.response_text.strip() == row["answer"])),
        encode=lambda row: [],
        extras=extras,
    )


def roles(*names: str, turns=None, **kw) -> MultiAgentConfig:
    return MultiAgentConfig(roles=[{"name": n, "prompt": n} for n in names], turns=turns, **kw)


def test_each_role_view_is_its_own_exact_token_sequence():
    """a, b, a: a's second turn sees b's turn as a user message (mask 0); b's opening holds a's
    first turn; every id a role trains on is an id the engine returned for that role."""
    engine = RoleEngine({"a": ["8", "7"], "b": ["no"]})
    ma = roles("a", "b", turns=["a", "b", "a"])
    group = asyncio.run(rollout(ctx_for(engine, ma), ROW))
    a, b = group.samples
    assert (a.metadata["role"], b.metadata["role"]) == ("a", "b")
    eos = TOK.eos_token_id
    a_prompt = chat_ids([{"role": "system", "content": "a"}, {"role": "user", "content": "3+4"}])
    assert a.prompt_ids == a_prompt
    obs = ids_of("<|user|>b: no<|end|><|assistant|>")
    assert a.response_ids == ids_of("8") + [eos] + obs + ids_of("7") + [eos]
    assert a.loss_mask == [1, 1] + [0] * len(obs) + [1, 1]
    assert a.rollout_logprobs == [-0.1, -0.2] + [0.0] * len(obs) + [-0.1, -0.2]
    assert a.versions == [3, 3] + [-1] * len(obs) + [3, 3]
    # a's second turn was generated from exactly its view so far, which is what the chat template
    # renders for the same conversation
    second = [p for r, p in engine.prompts if r == "a"][1]
    assert second == a.prompt_ids + a.response_ids[:-2]
    assert second == chat_ids(
        [
            {"role": "system", "content": "a"},
            {"role": "user", "content": "3+4"},
            {"role": "assistant", "content": "8"},
            {"role": "user", "content": "b: no"},
        ]
    )
    b_prompt = chat_ids(
        [
            {"role": "system", "content": "b"},
            {"role": "user", "content": "3+4"},
            {"role": "user", "content": "a: 8"},
        ]
    )
    assert b.prompt_ids == b_prompt and b.response_ids == ids_of("no") + [eos]
    assert b.loss_mask == [1, 1, 1]
    # default scoring: the reward function on the last turn ("7"), credited to the whole team
    assert a.reward == b.reward == 1.0
    assert a.reward_info["team_reward"] == 1.0 and a.response_text == "7"
    assert a.metadata["metrics"]["agent/turns"] == 2.0


def test_the_task_sft_prompts_are_the_episode_prompts():
    """SFT rows of proposer_checker render the very ids each role is prompted with in RL."""
    engine = RoleEngine(
        {proposer_checker.PROMPTS["proposer"]: ["8"], proposer_checker.PROMPTS["checker"]: ["no"]}
    )
    ma = MultiAgentConfig(
        roles=[{"name": n, "prompt": p} for n, p in proposer_checker.PROMPTS.items()],
        scorer="weir.tasks.proposer_checker:score",
        credit="role",
    )
    group = asyncio.run(rollout(ctx_for(engine, ma, scorer=proposer_checker.score), ROW))
    proposer, checker = group.samples
    sft = proposer_checker.sft_rows(50, seed=0, digits=1)
    by_role = {r["role"]: r for r in sft}
    assert {r["role"] for r in sft} == {"proposer", "checker"} and len(sft) == 100
    for sample, role in ((proposer, "proposer"), (checker, "checker")):
        row = by_role[role]
        messages = [dict(m) for m in row["messages"]]
        messages[1]["content"] = "3+4"
        if role == "checker":
            messages[2]["content"] = "proposer: 8"
        assert encode_prompt(TOK, {"messages": messages}) == sample.prompt_ids
    # 8 is wrong, the checker said no: proposer 0, checker 1, team 0
    assert (proposer.reward, checker.reward) == (0.0, 1.0)
    assert proposer.reward_info["team_reward"] == 0.0


@pytest.mark.parametrize(
    "mode, expected",
    [("team", (0.0, 0.0)), ("role", (1.0, 0.0)), ("mixed", (0.25, 0.0))],
)
def test_credit_modes_give_each_role_its_reward(mode, expected):
    engine = RoleEngine({"p": ["7"], "c": ["no"]})

    def scorer(episode, row):  # the proposer was right, the checker rejected: team fails
        right = episode.last("p") == row["answer"]
        return {"team": float(right and episode.last("c") == "yes"), "p": float(right), "c": 0.0}

    ma = roles("p", "c", scorer="x:y", credit=mode, team_weight=0.75)
    p, c = asyncio.run(rollout(ctx_for(engine, ma, scorer=scorer), ROW)).samples
    assert (p.reward, c.reward) == expected
    assert p.reward_info["role_reward"] == 1.0 and c.reward_info["team_reward"] == 0.0


@given(team=st.floats(-5, 5), own=st.floats(-5, 5), w=st.floats(0, 1))
def test_mixed_credit_is_the_weighted_sum(team, own, w):
    out = Outcome(team, {"r": own})
    assert credit(out, "r", "mixed", w) == pytest.approx(w * team + (1 - w) * own, abs=1e-12)
    assert credit(out, "r", "team") == team and credit(out, "r", "role") == own


def test_scorer_failures_fail_the_samples_and_are_counted():
    engine = RoleEngine({"p": ["7"], "c": ["yes"]})

    def boom(episode, row):
        raise RuntimeError("no judge today")

    def only_team(episode, row):
        return 1.0

    async def nan(episode, row):
        return {"team": math.nan}

    ma = roles("p", "c", scorer="x:y", credit="role")
    for scorer, message in (
        (boom, "ScorerError: RuntimeError: no judge today"),
        (only_team, "ScorerError: multi_agent.credit=role needs role 'p'"),
        (nan, "ScorerError: ValueError: the scorer's 'team' reward must be a finite number"),
    ):
        group = asyncio.run(rollout(ctx_for(engine, ma, scorer=scorer), ROW))
        p = group.samples[0]
        assert p.status == Status.FAILED and p.reward is None
        assert p.error.startswith(message), p.error
        assert summarize([group])["rollout/failed"] == 2.0
    with pytest.raises(ValueError, match="neither 'team' nor a role"):
        parse_outcome({"q": 1.0}, ["p", "c"])


def test_a_slow_scorer_times_out_and_fails_the_episode():
    async def slow(episode, row):
        await asyncio.sleep(5)
        return 1.0

    ctx = ctx_for(
        RoleEngine({"p": ["7"], "c": ["yes"]}), roles("p", "c", scorer="x:y"), scorer=slow
    )
    ctx.reward_timeout_s = 0.05
    group = asyncio.run(rollout(ctx, ROW))
    assert [s.error for s in group.samples] == [
        "ScorerError: TimeoutError: the scorer took longer than 0.05 s"
    ] * 2


def test_a_turn_cut_by_the_token_limit_ends_the_episode_truncated():
    engine = RoleEngine({"p": ["123456"], "c": ["yes"]})
    ma = roles("p", "c")
    ma.roles[0].max_new_tokens = 3
    engine.finish = "length"
    group = asyncio.run(rollout(ctx_for(engine, ma), ROW))
    (p,) = group.samples  # the checker never acted: no sample for it
    assert p.status == Status.TRUNCATED and p.reward_info["stop"] == "length"
    assert p.reward == 0.0


def _episode_group(gid: int, rewards: dict[str, list[float]]) -> Group:
    samples = []
    for e in range(len(next(iter(rewards.values())))):
        for role, rs in rewards.items():
            samples.append(
                Sample(
                    prompt_ids=[5, 6],
                    response_ids=[7, 8, 9],
                    loss_mask=[1, 1, 1] if role == "p" else [0, 1, 1],
                    reward=rs[e],
                    group_id=gid,
                    metadata={"role": role, "episode": e},
                    reward_info={"team_reward": rs[e] if role == "p" else None},
                )
            )
    return Group(samples=samples, group_id=gid)


def test_each_role_gets_its_own_group_baseline():
    """GRPO per (prompt, role), worked out by hand: A = (r - mean) / (std + 1e-6), unbiased std."""
    groups = [
        _episode_group(0, {"p": [1.0, 0.0, 0.0], "c": [1.0, 1.0, 0.0]}),
        _episode_group(1, {"p": [0.5, 0.5, 0.5], "c": [0.0, 0.0, 1.0]}),
    ]
    batch = make_batch(groups, version=0)
    roles_ = [s.metadata["role"] for s in batch.samples]
    assert roles_ == ["p", "c"] * 6
    ids = batch.group_ids.tolist()
    assert ids == [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]
    adv = algo.compute_advantages("grpo", batch.rewards, batch.response_mask, batch.group_ids)
    first = adv.advantages[:, 2].tolist()  # every sample trains token 2
    # prompt 0, role p: rewards 1, 0, 0 -> mean 1/3, std sqrt(1/3)
    sd = math.sqrt(1 / 3) + 1e-6  # unbiased std of (1, 0, 0) and of (1, 1, 0) alike
    expected = [
        (2 / 3) / sd,  # prompt 0, episode 0, p: 1 of (1, 0, 0), mean 1/3
        (1 / 3) / sd,  # prompt 0, episode 0, c: 1 of (1, 1, 0), mean 2/3
        (-1 / 3) / sd,  # episode 1, p: 0
        (1 / 3) / sd,  # episode 1, c: 1
        (-1 / 3) / sd,  # episode 2, p: 0
        (-2 / 3) / sd,  # episode 2, c: 0
        0.0,  # prompt 1, p: (0.5, 0.5, 0.5) has no spread
        (-1 / 3) / sd,  # prompt 1, c: 0 of (0, 0, 1)
        0.0,
        (-1 / 3) / sd,
        0.0,
        (2 / 3) / sd,
    ]
    assert first == pytest.approx(expected, abs=1e-5)
    # pooling the roles of a prompt would give other numbers: the per-role split is what we see
    pooled = algo.compute_advantages(
        "grpo",
        batch.rewards,
        batch.response_mask,
        torch.tensor([g.group_id for g in groups for _ in g.samples]),
    )
    assert pooled.advantages[0, 2].item() != pytest.approx(expected[0], abs=1e-3)
    # the checker's first token is context (mask 0): no advantage there
    assert adv.advantages[1, 0] == 0.0


def test_per_role_metrics_and_team_evaluation():
    groups = [
        _episode_group(0, {"p": [1.0, 0.0], "c": [0.5, 1.0]}),
        _episode_group(1, {"p": [1.0, 1.0], "c": [0.0, 0.0]}),
    ]
    m = summarize(groups)
    assert m["reward/p/mean"] == pytest.approx(0.75)
    assert m["reward/c/mean"] == pytest.approx(0.375)
    assert m["reward/team/mean"] == pytest.approx(0.75)  # team rewards recorded on p: 1, 0, 1, 1
    assert m["response/c/length_mean"] == 2.0 and m["rollout/p/samples"] == 4.0

    rows = [{"prompt": "a"}, {"prompt": "b"}]
    it = iter(groups)

    async def fn(ctx, row):
        return next(it)

    ctx = ctx_for(RoleEngine({"p": ["x"]}), roles("p"), n=2)
    metrics, _ = evaluate(ctx, rows, fn)
    assert metrics["eval/accuracy"] == pytest.approx(0.75)  # 3 of 4 episodes: team reward 1
    assert metrics["eval/p/accuracy"] == pytest.approx(0.75)
    assert metrics["eval/c/accuracy"] == pytest.approx(0.25)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["multi_agent.turns=[a, z]"], "not in multi_agent.roles"),
        (["multi_agent.credit=role"], "needs per-role rewards"),
        (["rollout.function=weir.rollout.single_turn:rollout"], "ignores it"),
        (["multi_agent.roles=[]"], "needs multi_agent.roles"),
        (["multi_agent.roles=[{name: team}, {name: b}]"], "rename the role"),
        (["multi_agent.roles=[{name: a}, {name: a}]"], "must be distinct"),
    ],
)
def test_config_refuses_what_it_cannot_run(overrides, message):
    base = [
        "data.task=proposer_checker",
        "rollout.function=weir.rollout.multi_agent:rollout",
        "multi_agent.roles=[{name: a}, {name: b}]",
    ]
    with pytest.raises(ConfigError, match=message):
        build_config({}, [*base, *overrides])


@pytest.mark.parametrize("name", ["proposer_checker", "relay", "relay_quick"])
def test_example_role_prompts_are_the_ones_the_task_trains_in_sft(name):
    from pathlib import Path

    from weir.config import load_config
    from weir.tasks import relay

    cfg = load_config(Path(__file__).parents[2] / "examples" / f"{name}.yaml")
    task = {"proposer_checker": proposer_checker, "relay": relay}[cfg.data.task]
    assert {r.name: r.prompt for r in cfg.multi_agent.roles} == task.PROMPTS


def test_demo_summary_has_each_roles_accuracy_before_and_after():
    from weir.loop.demo import role_summary

    evals = [
        {"eval/accuracy": 0.1, "eval/p/accuracy": 0.2, "eval/pass@1": 0.1},
        {"eval/accuracy": 0.3, "eval/p/accuracy": 0.4},
        {"eval/accuracy": 0.3, "eval/p/accuracy": 0.6},
        {"eval/accuracy": 0.3, "eval/p/accuracy": 0.8},
    ]
    assert role_summary(evals) == {
        "role/p/accuracy_after_sft": 0.2,
        "role/p/accuracy_after_rl_last3_mean": pytest.approx(0.6),
    }
    assert role_summary([{"eval/accuracy": 0.5}]) == {}
