"""verifiers: an environment's dataset, turns and rubric as weir's rows, episodes and reward; its
turns played by weir's engine (the model's ids never re-encoded, the environment's turns masked),
and a broken environment or rubric contained and counted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import weir

vf = pytest.importorskip("verifiers")
datasets = pytest.importorskip("datasets")

from weir.adapters import adapter_rows  # noqa: E402
from weir.adapters.verifiers import load, rollout  # noqa: E402
from weir.config import load_config  # noqa: E402
from weir.config.schema import AgentConfig  # noqa: E402
from weir.data.sample import Status  # noqa: E402
from weir.engine.base import Completion, SamplingParams  # noqa: E402
from weir.rollout.collect import collect_groups  # noqa: E402
from weir.rollout.single_turn import RolloutContext  # noqa: E402
from weir.tasks import verifiers_envs  # noqa: E402
from weir.tasks.tiny_model import build_tokenizer  # noqa: E402

TOK = build_tokenizer()
ENVS = "weir.tasks.verifiers_envs"


def ids_of(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """Answers each generate call with the next scripted turn (then EOS); token t gets log-prob
    -(t + 1) / 10 and version 3, so any misalignment would show."""

    def __init__(self, turns: list[str]) -> None:
        self.turns, self.returned, self.prompts, self.version = list(turns), [], [], 3

    async def generate(self, prompt_ids, params: SamplingParams) -> list[Completion]:
        self.prompts.append(list(prompt_ids))
        ids = [*ids_of(self.turns[len(self.returned) % len(self.turns)]), TOK.eos_token_id]
        self.returned.append(ids)
        lp = [-(t + 1) / 10 for t in range(len(ids))]
        return [
            Completion(token_ids=ids, logprobs=lp, versions=[3] * len(ids), finish_reason="stop")
        ]


def config(env: str, overrides: tuple[str, ...] = (), **env_args):
    """A run config whose verifiers section names `env` (a factory of weir.tasks.verifiers_envs
    or a dotted path) with `env_args`."""
    path = f"{ENVS}:{env}" if env in ("arithmetic", "calculator", "higher_lower") else env
    return load_config(
        None,
        [
            f"verifiers.env={path}",
            f"verifiers.env_args={json.dumps(env_args)}",
            "rollout.function=weir.adapters.verifiers:rollout",
            *overrides,
        ],
    )


def play(engine, cfg, rows: list[dict], n: int = 1, env_timeout_s: float = 5.0):
    """The groups and step metrics of `rows` played with `engine`."""
    ctx = RolloutContext(
        engine=engine,
        tokenizer=TOK,
        sampling=SamplingParams(n=n, max_new_tokens=64, seed=0),
        reward_fn=None,
        encode=None,
        reward_timeout_s=1.0,
        extras={
            "verifiers": cfg.verifiers,
            "agent": AgentConfig(max_tokens=256, env_timeout_s=env_timeout_s),
        },
    )
    return collect_groups(ctx, rows, rollout)


def row_of(answer: str, question: str = "Guess my digit (0-9).") -> dict:
    entry = {"prompt": [{"role": "user", "content": question}], "answer": answer, "example_id": 0}
    return {"prompt": question, "answer": answer, "vf_input": entry}


def test_rows_are_the_environments_dataset_with_its_prompts_and_a_held_out_split():
    args = {"train_size": 50, "eval_size": 10, "system_prompt": "Add."}
    cfg = config("arithmetic", ("data.eval_size=10", "data.train_size=50"), **args)
    train, test = adapter_rows(cfg, "train"), adapter_rows(cfg, "test")
    env = load(cfg.verifiers)
    assert len(train) == 50 and len(test) == 10
    assert [r["prompt"] for r in train] == env.get_dataset()["question"]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}  # held out
    a, b = (int(x) for x in test[0]["prompt"].split("+"))
    assert test[0]["answer"] == str(a + b)
    assert test[0]["vf_input"]["prompt"] == [  # the environment's system prompt, as it sets it
        {"role": "system", "content": "Add."},
        {"role": "user", "content": test[0]["prompt"]},
    ]
    # without an eval dataset, its last data.eval_size rows are held out, the rest trained on
    cfg = config(f"{__name__}:dataset_only", ("data.eval_size=5", "data.train_size=100"))
    train, test = adapter_rows(cfg, "train"), adapter_rows(cfg, "test")
    assert [r["answer"] for r in train] == [str(i) for i in range(25)]
    assert [r["answer"] for r in test] == [str(i) for i in range(25, 30)]


def test_an_installed_environment_loads_by_its_id(tmp_path, monkeypatch):
    """An id names an environment package (verifiers' load_environment: `vf-x` imports `vf_x`)."""
    module = "from weir.tasks.verifiers_envs import higher_lower as load_environment\n"
    (tmp_path / "weir_vf_game.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config("weir-vf-game", ("data.eval_size=3",), train_size=10, eval_size=3, seed=5)
    rows = adapter_rows(cfg, "test")
    assert [r["answer"] for r in rows] == load(
        config("higher_lower", seed=5).verifiers
    ).get_eval_dataset(n=3)["answer"]


def dataset_only():
    """A SingleTurnEnv with a training dataset only (30 rows, answers 0..29)."""
    rows = [{"question": f"say {i}", "answer": str(i)} for i in range(30)]
    return vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows), rubric=vf.Rubric(funcs=[]))


def test_a_tool_env_episode_is_token_exact_with_its_tool_turn_masked_and_its_rubric_the_reward():
    cfg = config("calculator", ("data.eval_size=4",), train_size=4, eval_size=4)
    row = adapter_rows(cfg, "test")[0]
    a, b = (int(x) for x in row["prompt"].split("*"))
    call = f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
    engine = ScriptedEngine([call, str(a * b)])
    (group,), _ = play(engine, cfg, [row])
    sample = group.samples[0]

    t0, t1 = engine.returned
    obs = ids_of(
        f"<|tool|>{a * b}<|end|><|assistant|>"
    )  # the tool message in the template's layout
    assert sample.response_ids == t0 + obs + t1
    assert sample.loss_mask == [1] * len(t0) + [0] * len(obs) + [1] * len(t1)
    lp = [[-(t + 1) / 10 for t in range(len(ids))] for ids in (t0, t1)]
    assert sample.rollout_logprobs == lp[0] + [0.0] * len(obs) + lp[1]
    assert sample.versions == [3] * len(t0) + [-1] * len(obs) + [3] * len(t1)
    assert engine.prompts == [sample.prompt_ids, sample.prompt_ids + t0 + obs]  # never re-encoded
    assert TOK.decode(sample.prompt_ids) == (  # the environment's tools, shown by the template
        "<|system|>tools:\nmultiply(a, b): Multiply two integers.<|end|>"
        f"<|user|>{row['prompt']}<|end|><|assistant|>"
    )
    assert sample.status == Status.COMPLETED and sample.reward == 1.0
    info = sample.reward_info
    assert info["exact_answer"] == 1.0 and info["total_tool_calls"] == 1.0  # the rubric's metrics
    assert info["multiply_calls"] == 1.0 and info["turns"] == 2 and info["tool_calls"] == 1
    (group,), _ = play(ScriptedEngine([call, str(a * b + 1)]), cfg, [row])
    assert group.samples[0].reward == 0.0  # a wrong final answer
    (group,), m = play(ScriptedEngine(["<tool_call>\n{oops\n</tool_call>"]), cfg, [row])
    assert group.samples[0].reward == 0.0 and m["agent/malformed_calls"] == 1  # no call: it ends


def test_a_multi_turn_env_answers_as_the_user_and_a_final_response_ends_the_game():
    cfg = config("higher_lower", max_turns=4)
    engine = ScriptedEngine(["5", "9", "7", "7"])
    (group,), _ = play(engine, cfg, [row_of("7")])
    sample = group.samples[0]
    t0, t1, t2 = engine.returned  # the right guess ends the game: no fourth turn
    up = ids_of("<|user|>higher<|end|><|assistant|>")
    down = ids_of("<|user|>lower<|end|><|assistant|>")
    assert sample.response_ids == t0 + up + t1 + down + t2
    assert sample.loss_mask == [1] * len(t0) + [0] * len(up) + [1] * len(t1) + [0] * len(down) + [
        1
    ] * len(t2)
    assert sample.reward == pytest.approx(1 / 3) and sample.reward_info["stop"] == "done"
    (group,), _ = play(ScriptedEngine(["1"]), cfg, [row_of("7")])
    lost = group.samples[0]  # out of turns (the environment's max_turns): reward 0
    assert lost.reward == 0.0 and lost.reward_info["turns"] == 4


def shared_credit(completions, answers, parser) -> list[float]:
    """A group reward: each right answer gets 1 / (right answers in the group)."""
    right = [float(parser.parse_answer(c) == a) for c, a in zip(completions, answers, strict=True)]
    return [r / max(sum(right), 1.0) for r in right]


async def says_four(completion) -> float:
    """An async reward function (weight 0: a metric)."""
    await asyncio.sleep(0)
    return float(completion[-1]["content"].strip() == "4")


def group_env():
    rows = [{"question": "say 4", "answer": "4"}] * 4
    rubric = vf.Rubric(funcs=[shared_credit, says_four], weights=[1.0, 0.0])
    return vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows), rubric=rubric)


def test_the_rubric_scores_the_episodes_of_a_row_together():
    cfg = config(f"{__name__}:group_env")
    row = adapter_rows(config(f"{__name__}:group_env", ("data.eval_size=1",)), "test")[0]
    (group,), _ = play(ScriptedEngine(["4", "5", "4", "3"]), cfg, [row], n=4)
    texts = [s.response_text.strip() for s in group.samples]
    assert sorted(texts) == ["3", "4", "4", "5"]
    assert [s.reward for s in group.samples] == [0.5 if t == "4" else 0.0 for t in texts]
    assert [s.reward_info["says_four"] for s in group.samples] == [float(t == "4") for t in texts]


class Faulty(vf.MultiTurnEnv):
    """env_response fails by the row's answer: 1 raises, 2 hangs, 3 answers with an image."""

    async def env_response(self, messages, state, **kwargs):
        kind = state["answer"]
        if kind == "1":
            raise RuntimeError("the environment broke")
        if kind == "2":
            await asyncio.sleep(3600)
        if kind == "3":
            image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
            return [vf.UserMessage(content=[image])]
        return [vf.UserMessage(content="again")]


def faulty_env():
    rows = [{"question": "go", "answer": str(i)} for i in range(4)]
    data = datasets.Dataset.from_list(rows)
    return Faulty(dataset=data, max_turns=2, rubric=vf.Rubric(funcs=[lambda completion: 1.0]))


def test_an_environment_that_raises_hangs_or_answers_malformed_fails_only_its_episode():
    cfg = config(f"{__name__}:faulty_env")
    rows = [row_of(str(i), "go") for i in range(4)]
    groups, m = play(ScriptedEngine(["x"]), cfg, rows, env_timeout_s=0.5)
    samples = {g.row["answer"]: g.samples[0] for g in groups}
    assert samples["0"].status == Status.COMPLETED and samples["0"].reward == 1.0
    assert "EnvError: RuntimeError: the environment broke" in samples["1"].error
    assert "EnvError: TimeoutError" in samples["2"].error
    assert "EnvError: TypeError" in samples["3"].error
    assert all(samples[k].status == Status.FAILED and samples[k].reward is None for k in "123")
    assert m["rollout/failed"] == 3 and m["agent/env_errors"] == 3
    assert m["agent/env_timeouts"] == 1 and m["agent/env_bad_results"] == 1


async def forever(completion) -> float:
    await asyncio.sleep(3600)
    return 1.0


def short(completions) -> list[float]:
    return [1.0]  # one reward for a group of several: the rubric's own aggregation fails


def rubric_env(func: str):
    rows = [{"question": "go", "answer": "1"}]
    fn = {"forever": forever, "short": short}[func]
    return vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows), rubric=vf.Rubric(funcs=[fn]))


@pytest.mark.parametrize(
    "func, error",
    [("forever", "RewardError: timeout"), ("short", "RewardError: IndexError")],
)
def test_a_rubric_that_hangs_or_fails_fails_the_rows_samples_and_the_run_goes_on(func, error):
    cfg = config(f"{__name__}:rubric_env", func=func)
    (group,), m = play(ScriptedEngine(["1"]), cfg, [row_of("1", "go")], n=2)
    assert m["rollout/failed"] == 2
    assert all(s.status == Status.FAILED and s.error.startswith(error) for s in group.samples)


def judge_env():
    from openai import AsyncOpenAI

    judge = vf.JudgeRubric(judge_client=AsyncOpenAI(api_key="none", base_url="http://127.0.0.1:9"))
    return vf.SingleTurnEnv(dataset=group_env().dataset, rubric=judge)


def two_envs():
    return vf.EnvGroup(envs=[group_env(), group_env()], env_names=["a", "b"])


def not_an_env():
    return 3


def raises():
    raise OSError("no data here")


@pytest.mark.parametrize(
    "env, message",
    [
        (f"{__name__}:judge_env", "JudgeRubric asks an outside LLM"),
        (f"{__name__}:two_envs", "EnvGroup, which weir cannot play"),
        (f"{__name__}:not_an_env", "gave a int, not a vf.Environment"),
        (f"{__name__}:raises", "raised OSError: no data here"),
        ("no-such-verifiers-env", "no-such-verifiers-env"),
    ],
)
def test_an_environment_weir_cannot_play_is_refused_in_one_line(env, message):
    cfg = config(env, ("data.eval_size=1",))
    with pytest.raises(ValueError, match=message) as err:
        adapter_rows(cfg, "test")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.function=weir.rollout.multi_turn:rollout", "set rollout.function=weir.adapters"),
        ("reward.function=exact_match", "the environment's rubric is the reward"),
        ("data.system_prompt=hi", "defines its system prompt"),
    ],
)
def test_settings_that_contradict_the_environment_are_refused_when_the_run_starts(
    override, message
):
    from weir.adapters import adapter_extras

    cfg = config("higher_lower", (override,))
    with pytest.raises(ValueError, match=message):
        adapter_extras(cfg)
    assert adapter_extras(config("higher_lower"))["verifiers"].env == f"{ENVS}:higher_lower"


EXAMPLES = Path(__file__).parents[2] / "examples"
SMALL = [
    "run.eval_every=0",
    "rollout.batch_prompts=4",
    "rollout.n=4",
    "model.path=tiny:nano",
    "data.eval_size=4",
    "verifiers.env_args.train_size=64",
    "verifiers.env_args.eval_size=4",
]


def capturing(groups: list):
    """The adapter's rollout function, keeping every group it returns."""

    async def fn(ctx, row):
        group = await rollout(ctx, row)
        groups.append(group)
        return group

    return fn


def spans(sample) -> list[tuple[int, list[int]]]:
    """The response as runs of equal loss_mask: [(mask, ids), ...]."""
    out: list[tuple[int, list[int]]] = []
    for tok, m in zip(sample.response_ids, sample.loss_mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(tok)
        else:
            out.append((m, [tok]))
    return out


def text(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=True).strip()


def three_rl_steps(example: str, tmp_path) -> list:
    """Every sample of 3 GRPO steps (and the evaluations) of `example`, after checking that no
    rollout failed and that the engine's log-probs of the recorded tokens are the trainer's (fp32,
    both on the CPU): the tokens trained on are the ones the engine sampled."""
    groups: list = []
    result = weir.run(
        EXAMPLES / example,
        [f"run.dir={tmp_path}", "run.steps=3", *SMALL],
        rollout=capturing(groups),
    )
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 3 and all(h["rollout/failed"] == 0 for h in steps)
    assert all(h["mismatch/abs_logp_diff"] < 1e-4 for h in steps)
    return [s for g in groups for s in g.samples]


@pytest.mark.slow
def test_three_rl_steps_on_a_single_turn_env_train_on_the_engines_tokens(tmp_path):
    samples = three_rl_steps("verifiers_arithmetic.yaml", tmp_path)
    assert len(samples) == 3 * 4 * 4 + 2 * 4  # 3 steps, and the evaluations before and after
    for s in samples:
        assert s.loss_mask == [1] * len(s.response_ids)  # one model turn, all trained
        assert s.reward == float(text(s.response_ids) == s.row["answer"])  # the rubric's rule
        assert TOK.decode(s.prompt_ids) == f"<|user|>{s.row['prompt']}<|end|><|assistant|>"


@pytest.mark.slow
def test_three_rl_steps_on_a_multi_turn_env_mask_its_turns(tmp_path):
    samples = three_rl_steps("verifiers_higher_lower.yaml", tmp_path)
    env_turns = 0
    for s in samples:
        runs, guesses = spans(s), []
        for (mask, ids), nxt in zip(runs, [*runs[1:], None], strict=True):
            if mask == 1:
                guesses.append(text(ids))
                continue
            # an environment turn: exactly the template's user message with the game's answer
            # to the guess before it, and never trained on
            env_turns += 1
            reply = verifiers_envs.hint(guesses[-1], int(s.row["answer"]))
            assert TOK.decode(ids) == f"<|user|>{reply}<|end|><|assistant|>"
            assert nxt is not None and nxt[0] == 1
        assert runs[0][0] == 1 and len(guesses) <= 3
        right = [
            i
            for i, g in enumerate(guesses)
            if verifiers_envs.hint(g, int(s.row["answer"])) == "correct"
        ]
        assert s.reward == pytest.approx(1 / (right[0] + 1) if right else 0.0)
    assert env_turns > 0
