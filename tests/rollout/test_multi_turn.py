"""Multi-turn episodes: token-exact trajectories, masks, stopping rules, rewards, contained errors."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from weir.config import build_config
from weir.config.schema import AgentConfig
from weir.data.sample import Status
from weir.engine.base import Completion, SamplingParams
from weir.engine.torch_engine import TorchEngine
from weir.rollout.collect import collect_groups
from weir.rollout.env import ToolEnv
from weir.rollout.multi_turn import observation_codec, rollout, run_episode
from weir.rollout.single_turn import RolloutContext
from weir.tasks.tiny_model import build_tokenizer

TOK = build_tokenizer()


def ids_of(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """Plays the given turns in order (one per generate call), recording every prompt it was given.

    Token t of a turn gets log-prob -(t + 1) / 10 and version 7, so misalignment would show.
    """

    def __init__(self, turns: list[str], finish: str = "stop") -> None:
        self.turns, self.finish, self.version = list(turns), finish, 7
        self.prompts: list[list[int]] = []
        self.returned: list[list[int]] = []
        self.params: list[SamplingParams] = []

    async def generate(self, prompt_ids, params: SamplingParams) -> list[Completion]:
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        text = self.turns[min(len(self.returned), len(self.turns) - 1)]
        ids = ids_of(text)[: params.max_new_tokens]
        finish = self.finish
        if finish == "stop" and len(ids) < params.max_new_tokens:
            ids = [*ids, TOK.eos_token_id]
        elif finish == "stop":
            finish = "length"
        self.returned.append(ids)
        return [
            Completion(
                token_ids=ids,
                logprobs=[-(t + 1) / 10 for t in range(len(ids))],
                versions=[7] * len(ids),
                finish_reason=finish,
            )
        ]


def mul(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def exact(sample, row):
    return float(sample.response_text.strip() == row["answer"])


def make_ctx(engine, agent: AgentConfig, n: int = 1, reward=exact) -> RolloutContext:
    return RolloutContext(
        engine=engine,
        tokenizer=TOK,
        sampling=SamplingParams(n=n, max_new_tokens=512),
        reward_fn=reward,
        encode=lambda row: ids_of(
            TOK.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}],
                tokenize=False,
                add_generation_prompt=True,
            )
        ),
        extras={"agent": agent},
    )


ROW = {"prompt": "6*7", "answer": "42"}
CALL = '<tool_call>\n{"name": "mul", "arguments": {"a": 6, "b": 7}}\n</tool_call>'


def test_trajectory_is_the_exact_concatenation_of_engine_and_observation_ids():
    engine = ScriptedEngine([CALL, CALL.replace("7}", "1}"), "42"])
    agent = AgentConfig(tools=[f"{__name__}:mul"], show_tools=False, max_turns=5)
    ctx = make_ctx(engine, agent)
    sample = asyncio.run(run_episode(ctx, ROW, ToolEnv([mul]), agent))

    obs = [ids_of("<|tool|>42<|end|><|assistant|>"), ids_of("<|tool|>6<|end|><|assistant|>")]
    t0, t1, t2 = engine.returned
    assert sample.response_ids == t0 + obs[0] + t1 + obs[1] + t2
    assert sample.loss_mask == [1] * len(t0) + [0] * len(obs[0]) + [1] * len(t1) + [0] * len(
        obs[1]
    ) + [1] * len(t2)
    lp = lambda ids: [-(t + 1) / 10 for t in range(len(ids))]  # noqa: E731
    assert sample.rollout_logprobs == lp(t0) + [0.0] * len(obs[0]) + lp(t1) + [0.0] * len(
        obs[1]
    ) + lp(t2)
    assert sample.versions == [7] * len(t0) + [-1] * len(obs[0]) + [7] * len(t1) + [-1] * len(
        obs[1]
    ) + [7] * len(t2)
    # each turn continues from exactly the ids so far: no re-tokenisation anywhere
    p = sample.prompt_ids
    assert engine.prompts == [p, p + t0 + obs[0], p + t0 + obs[0] + t1 + obs[1]]
    assert sample.status == Status.COMPLETED and sample.reward == 1.0
    assert sample.response_text == "42"
    assert sample.reward_info["turns"] == 3 and sample.reward_info["tool_calls"] == 2
    assert sample.reward_info["stop"] == "done"
    # the decoded transcript equals what the chat template renders for the same conversation
    chat = [
        {"role": "user", "content": "6*7"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "mul", "arguments": {"a": 6, "b": 7}}],
        },
        {"role": "tool", "content": "42"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "mul", "arguments": {"a": 6, "b": 1}}],
        },
        {"role": "tool", "content": "6"},
        {"role": "assistant", "content": "42"},
    ]
    assert TOK.decode(p + sample.response_ids) == TOK.apply_chat_template(chat, tokenize=False)


def test_observation_wrapper_comes_from_the_chat_template():
    codec = observation_codec(TOK)
    assert (codec.prefix, codec.suffix) == ("<|tool|>", "<|end|><|assistant|>")
    assert codec.encode("12") == [TOK.convert_tokens_to_ids("<|tool|>"), *ids_of("12"), 1, 4]


def test_torch_engine_trajectory_is_token_exact_and_on_policy(tiny_model_dir):
    """A real engine and a random model (most tokens made stop tokens, so turns end): every turn is followed by the
    observation, the ids line up, and the trainer's log-probs of the sampled tokens equal the
    engine's (possible only if no token was re-encoded)."""
    from weir.train.actor import Actor, ActorSettings
    from weir.train.batch import make_batch

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = TorchEngine(model, eos_token_ids=[TOK.eos_token_id], pad_token_id=0, seed=0)

    class Echo:  # never done: shows the model its own turn's length
        def reset(self, row):
            return None

        def step(self, action):
            return f"len={len(action)}", 0.0, False, {}

    returned = []
    original = engine.generate

    async def recording(prompt_ids, params):
        out = await original(prompt_ids, params)
        returned.append(out[0])
        return out

    engine.generate = recording
    try:
        agent = AgentConfig(max_turns=3, max_tokens=200)
        ctx = make_ctx(engine, agent)
        ctx = ctx.with_sampling(max_new_tokens=12, stop_token_ids=list(range(6, 200)), seed=3)
        sample = asyncio.run(run_episode(ctx, ROW, Echo(), agent))
        stats = engine.stats()
    finally:
        engine.close()
    assert sample.reward_info["turns"] == 3 and len(returned) == 3
    # turns 2 and 3 reused the KV of the turn before (the parity below holds with it)
    assert stats["prefix_hits"] == 2 and stats["prefix_reused_tokens"] > 0
    expected, mask, logprobs = [], [], []
    codec = observation_codec(TOK)
    for i, c in enumerate(returned):
        expected += c.token_ids
        mask += [1] * len(c.token_ids)
        logprobs += c.logprobs
        if i < 2:
            text = TOK.decode(c.token_ids, skip_special_tokens=True)
            obs = codec.encode(f"len={len(text)}")
            expected += obs
            mask += [0] * len(obs)
            logprobs += [0.0] * len(obs)
    assert sample.response_ids == expected and sample.loss_mask == mask
    assert sample.rollout_logprobs == logprobs
    sample.reward = 0.0
    from weir.data.sample import Group

    batch = make_batch([Group(samples=[sample])], version=0)
    cfg = build_config({}, ["rollout.batch_prompts=1", "rollout.n=1"])
    trainer_lp = Actor(model, ActorSettings.from_config(cfg)).logprobs(model, batch)[
        0, : len(sample.response_ids)
    ]
    m = torch.tensor(sample.loss_mask, dtype=torch.bool)
    engine_lp = torch.tensor(sample.rollout_logprobs)
    assert torch.allclose(trainer_lp[m], engine_lp[m], atol=1e-4)
    assert torch.all(engine_lp[~m] == 0) and all(
        v == -1 for v, k in zip(sample.versions, mask, strict=True) if not k
    )


def test_turn_and_token_limits_end_the_episode_as_truncated():
    agent = AgentConfig(tools=[f"{__name__}:mul"], max_turns=2, show_tools=False)
    engine = ScriptedEngine([CALL])
    s = asyncio.run(run_episode(make_ctx(engine, agent), ROW, ToolEnv([mul]), agent))
    assert len(engine.returned) == 2 and s.status == Status.TRUNCATED
    assert s.reward_info["stop"] == "max_turns" and s.reward == 0.0
    # the last turn's observation is not appended: the response ends with the model's tokens
    assert s.loss_mask[-1] == 1 and s.response_ids[-1] == TOK.eos_token_id

    agent = AgentConfig(tools=[f"{__name__}:mul"], max_turns=10, max_tokens=100, show_tools=False)
    engine = ScriptedEngine([CALL])
    s = asyncio.run(run_episode(make_ctx(engine, agent), ROW, ToolEnv([mul]), agent))
    assert s.status == Status.TRUNCATED and s.reward_info["stop"] in ("max_tokens", "length")
    assert len(s.response_ids) <= 100
    # every turn was asked for no more tokens than the episode had left
    for prompt, params in zip(engine.prompts, engine.params, strict=True):
        assert params.max_new_tokens == min(512, 100 - (len(prompt) - len(s.prompt_ids)))


def test_tool_errors_and_malformed_calls_become_observations_and_counts():
    def boom(x: int) -> int:
        """Always fails."""
        raise RuntimeError("kaput")

    def slow(x: int) -> int:
        """Too slow."""
        time.sleep(1.0)
        return x

    turns = [
        '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "slow", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "mul", "arguments": {"a": "x", "b": 1}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        "<tool_call>{not json</tool_call>",
        "I give up",
    ]
    agent = AgentConfig(max_turns=4, max_tokens=1000, show_tools=False)
    engine = ScriptedEngine(turns)
    env = ToolEnv([boom, slow, mul], timeout_s=0.2)
    s = asyncio.run(run_episode(make_ctx(engine, agent), ROW, env, agent))
    assert s.status == Status.COMPLETED and s.reward == 0.0
    assert s.reward_info["tool_calls"] == 4 and s.reward_info["tool_errors"] == 4
    assert s.reward_info["malformed_calls"] == 1
    obs = TOK.decode(engine.prompts[1][len(engine.prompts[0]) + len(engine.returned[0]) :])
    lines = obs.removeprefix("<|tool|>").removesuffix("<|end|><|assistant|>").split("\n")
    assert len(lines) == 5 and all(line.startswith("error: ") for line in lines)
    assert "kaput" in lines[0] and "timed out" in lines[1] and "bad arguments" in lines[2]
    assert "unknown tool 'nope'" in lines[3] and "not valid JSON" in lines[4]
    assert s.metadata["metrics"]["agent/tool_errors"] == 4.0


def test_environment_rewards_are_discounted_and_added_to_the_task_reward():
    class Steps:
        """Async env: reward 1 per step, done after three steps; the first prompt comes from reset."""

        def __init__(self):
            self.n = 0

        async def reset(self, row):
            return f"compute {row['prompt']}"

        async def step(self, action):
            self.n += 1
            return ("again" if self.n < 3 else None), 1.0, self.n >= 3, {}

    for mode, expected in [("sum", 1.0 + 1 + 0.5 + 0.25), ("env", 1.75), ("task", 1.0)]:
        agent = AgentConfig(max_turns=5, turn_discount=0.5, reward=mode)
        engine = ScriptedEngine(["42"])
        s = asyncio.run(run_episode(make_ctx(engine, agent), ROW, Steps(), agent))
        assert s.reward == pytest.approx(expected), mode
        assert s.reward_info["env_rewards"] == [1.0, 1.0, 1.0]
        assert s.reward_info["env_return"] == pytest.approx(1.75)
        assert TOK.decode(s.prompt_ids) == "<|user|>compute 6*7<|end|><|assistant|>"


def test_an_environment_that_raises_fails_the_sample_not_the_run():
    class Broken:
        def reset(self, row):
            return None

        def step(self, action):
            raise KeyError("state")

    class BadShape(Broken):
        def step(self, action):
            return "only an observation"

    for env, msg in [(Broken(), "KeyError"), (BadShape(), "TypeError")]:
        agent = AgentConfig()
        s = asyncio.run(run_episode(make_ctx(ScriptedEngine(["x"]), agent), ROW, env, agent))
        assert s.status == Status.FAILED and s.reward is None and msg in s.error
        assert s.error.startswith("EnvError")


def test_rollout_runs_n_episodes_and_reports_agent_metrics():
    agent = AgentConfig(tools=[f"{__name__}:mul"], show_tools=True, max_turns=3)
    engine = ScriptedEngine([CALL, "42"])  # shared script: calls are served in order
    ctx = make_ctx(engine, agent, n=1)
    groups, metrics = collect_groups(ctx, [ROW], rollout)
    assert len(groups[0].samples) == 1
    assert metrics["agent/turns_mean"] == 2.0 and metrics["agent/tool_calls"] == 1.0
    assert metrics["agent/tool_errors"] == 0.0 and metrics["reward/mean"] == 1.0
    prompt = TOK.decode(groups[0].samples[0].prompt_ids)
    assert prompt.startswith("<|system|>tools:\nmul(a, b): Multiply two integers.<|end|>")
    assert math.isfinite(metrics["agent/turns"])


class GuessEnv:
    """The docs/agents.md example: guess a number in `tries` tries; reward 1 for a hit."""

    def __init__(self, tries: int = 3):
        self.max_tries = tries

    def reset(self, row):
        self.secret, self.tries = int(row["answer"]), 0
        return "Guess my number (1-100)."

    def step(self, action):
        self.tries += 1
        digits = "".join(ch for ch in action if ch.isdigit())
        guess = int(digits) if digits else -1
        if guess == self.secret:
            return None, 1.0, True, {}
        hint = "higher" if guess < self.secret else "lower"
        return hint, 0.0, self.tries >= self.max_tries, {}


def test_a_configured_env_class_plays_with_env_rewards_only():
    def never(sample, row):
        raise AssertionError("agent.reward=env must not call the reward function")

    agent = AgentConfig(env=f"{__name__}:GuessEnv", env_kwargs={"tries": 2}, reward="env")
    engine = ScriptedEngine(["10", "42", "50"])
    groups, metrics = collect_groups(make_ctx(engine, agent, reward=never), [ROW], rollout)
    (s,) = groups[0].samples
    assert s.reward == 1.0 and s.reward_info["env_rewards"] == [0.0, 1.0]
    assert TOK.decode(s.response_ids) == "10<|end|><|tool|>higher<|end|><|assistant|>42<|end|>"
    assert TOK.decode(s.prompt_ids) == "<|user|>Guess my number (1-100).<|end|><|assistant|>"

    engine = ScriptedEngine(["10", "20", "30"])  # two wrong guesses: the env ends the episode
    (g,), _ = collect_groups(make_ctx(engine, agent, reward=never), [ROW], rollout)
    assert g.samples[0].reward == 0.0 and len(engine.returned) == 2
    assert g.samples[0].status == Status.COMPLETED and g.samples[0].reward_info["stop"] == "done"


def test_seeded_episodes_are_reproducible_and_independent_across_prompts():
    agent = AgentConfig(max_turns=1)
    seeds = {}
    for prompt in ("1*2", "3*4", "1*2"):
        engine = ScriptedEngine(["x"])
        ctx = make_ctx(engine, agent, n=2).with_sampling(seed=5)
        asyncio.run(rollout(ctx, {"prompt": prompt, "answer": "2"}))
        seeds.setdefault(prompt, []).append(sorted(p.seed for p in engine.params))
    assert seeds["1*2"][0] == seeds["1*2"][1]  # same prompt, same seed: same draws
    assert len(set(seeds["1*2"][0])) == 2  # the group's episodes differ
    assert not set(seeds["1*2"][0]) & set(seeds["3*4"][0])  # other prompts draw other numbers


def test_engine_errors_are_rollout_errors_not_environment_errors():
    class DeadEngine(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            raise RuntimeError("engine down")

    agent = AgentConfig()
    groups, metrics = collect_groups(make_ctx(DeadEngine(["x"]), agent), [ROW], rollout)
    (s,) = groups[0].samples
    assert s.status == Status.FAILED and s.error.startswith("RolloutError: RuntimeError")
    assert metrics["rollout/failed"] == 1.0


def test_bad_reset_results_and_counters_fail_the_sample():
    class BadReset:
        def reset(self, row):
            return 42

        def step(self, action):
            return None, 0.0, True, {}

    class BadCounter(BadReset):
        def reset(self, row):
            return None

        def step(self, action):
            return None, 0.0, True, {"tool_errors": "two"}

    for env, fragment in [(BadReset(), "env.reset must return"), (BadCounter(), "tool_errors")]:
        agent = AgentConfig()
        s = asyncio.run(run_episode(make_ctx(ScriptedEngine(["x"]), agent), ROW, env, agent))
        assert s.status == Status.FAILED and s.error.startswith("EnvError: TypeError")
        assert fragment in s.error


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_agent_rollout_trains_in_both_loops_from_a_config(tmp_path, mode):
    import weir

    cfg = {
        "run": {"steps": 2, "eval_every": 0, "save_model": False},
        "model": {"path": "tiny:nano", "threads": 1},
        "data": {"task": "calculator", "task_options": {"digits": [2, 1]}, "eval_size": 4},
        "rollout": {
            "function": "weir.rollout.multi_turn:rollout",
            "n": 2,
            "batch_prompts": 2,
            "max_new_tokens": 6,
        },
        "agent": {"tools": ["weir.tasks.calculator:calc"], "tool_format": "tag", "max_turns": 2},
        "loop": {"mode": mode},
        "telemetry": {"console": False},
    }
    result = weir.run(cfg, [f"run.dir={tmp_path}"])
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["agent/turns_mean"] >= 1.0 and "agent/tool_errors" in h
        assert h["rollout/failed"] == 0.0


def test_two_runs_of_one_multi_turn_config_sample_the_same_episodes(tmp_path):
    """Later turns reach the engine in an order that varies with batching and thread timing; the
    turns' seeds come from (run seed, version, row), so two runs sample the same tokens."""
    import weir
    from weir.tasks.tiny_model import build_tiny_model

    # every other token id ends a turn, so untrained episodes play several short turns of
    # varying lengths (and their later turns reach the engine in varying order)
    model_dir = build_tiny_model(tmp_path / "model", size="nano", seed=0)
    gen = GenerationConfig.from_pretrained(model_dir)
    gen.eos_token_id = list(range(0, TOK.vocab_size, 2))
    gen.save_pretrained(model_dir)
    cfg = {
        "run": {"steps": 2, "eval_every": 0, "save_model": False, "seed": 3},
        "model": {"path": str(model_dir), "threads": 1},
        "data": {"task": "arithmetic", "eval_size": 4},
        "rollout": {
            "function": "weir.rollout.multi_turn:rollout",
            "n": 4,
            "batch_prompts": 4,
            "max_new_tokens": 6,
        },
        "agent": {
            "env": f"{__name__}:GuessEnv",
            "env_kwargs": {"tries": 4},
            "reward": "env",
            "max_turns": 4,
        },
        "telemetry": {"console": False, "dump_rollouts": True},
    }
    dumps = []
    for name in ("a", "b"):
        result = weir.run(cfg, [f"run.dir={tmp_path / name}"])
        lines = []
        for path in sorted((result.dir / "rollouts").glob("*.jsonl")):
            lines += [json.loads(line) for line in path.read_text().splitlines()]
        dumps.append([(r["prompt_ids"], r["response_ids"]) for r in lines])
    tool = TOK.convert_tokens_to_ids("<|tool|>")
    assert sum(r.count(tool) >= 2 for _, r in dumps[0]) >= 8  # episodes of 3 or more turns
    assert dumps[0] == dumps[1]
