"""The GUI task (weir.tasks.gui): screens, actions, the action-level and task-level rewards, the rows
of each stage, and SFT rows whose ids are exactly the episode's at that turn."""

from __future__ import annotations

import asyncio
import random

import pytest

from weir.config.schema import AgentConfig, VisionConfig
from weir.data.sample import Status
from weir.data.vision import attach_processor, encode_vision_prompt
from weir.engine.base import Completion, SamplingParams
from weir.rollout import multi_turn
from weir.rollout.single_turn import RolloutContext
from weir.tasks import gui
from weir.tasks.tiny_vlm import build_vlm_processor


@pytest.mark.parametrize("kind", gui.KINDS)
def test_the_expert_reaches_every_goal_with_an_action_reward_each_step(kind):
    for seed in range(20):
        goal = gui.make_goal(random.Random(seed), kind)
        env = gui.GuiEnv()
        env.reset({"goal": goal})
        actions = gui.expert_actions(goal)
        assert len(actions) == gui.STEPS[kind]
        for i, a in enumerate(actions):
            obs, reward, done, info = env.step(a)
            assert reward == 1.0
            assert done == (i == len(actions) - 1) == info["success"]
        assert obs is None


def test_wrong_or_malformed_actions_change_nothing_and_the_episode_has_slack():
    goal = gui.make_goal(random.Random(1), "menu")
    env = gui.GuiEnv()
    first = env.reset({"goal": goal})
    before = first.images[0].tobytes()
    right = gui.expert_actions(goal)[0]
    wrong = next(
        f"click({x}, {y})"
        for y in range(gui.GRID)
        for x in range(gui.GRID)
        if f"click({x}, {y})" != right
    )
    for action in (wrong, "tap(1, 1)", 'type("go")', "scroll(down)"):
        obs, reward, done, info = env.step(action)
        assert reward == 0.0 and not info["success"]
        if not done:
            assert obs.images[0].tobytes() == before
    assert done and obs is None  # 2 steps + 2 slack: the fourth action was the last
    assert info["valid"] is True and gui.parse_action("tap(1, 1)") is None


def test_a_form_needs_focus_the_right_word_then_the_button():
    goal = gui.make_goal(random.Random(4), "form")
    field, typed, press = gui.expert_actions(goal)
    env = gui.GuiEnv()
    env.reset({"goal": goal, "max_actions": 9})
    assert env.step(typed)[1] == 0.0  # not focused: nothing typed
    assert env.step(press)[1] == 0.0  # empty field: pressing does nothing
    assert env.step(field)[1] == 1.0
    other = next(w for w in gui.WORDS if w != goal["word"])
    assert env.step(f'type("{other}")')[1] == 0.0
    assert env.step(press)[1] == 0.0  # the wrong word
    assert env.step(typed)[1] == 1.0
    *_, info = env.step(press)
    assert info["success"]


def test_rows_test_split_is_whole_episodes_and_disjoint_from_train():
    train = gui.make_rows("train", 40, 0, stage="action")
    test = gui.make_rows("test", 40, 0, stage="action")
    assert all(r["max_actions"] == 1 and r["start"] < gui.STEPS[r["kind"]] for r in train)
    assert all(r["start"] == 0 and r["max_actions"] == gui.STEPS[r["kind"]] + 2 for r in test)
    assert not {r["goal_seed"] for r in train} & {r["goal_seed"] for r in test}
    assert gui.make_rows("test", 40, 0) == test  # the same arguments, the same rows
    with pytest.raises(ValueError, match="kinds"):
        gui.make_rows("train", 2, 0, kinds="press,drag")


class Expert:
    """An engine that plays the expert's actions of `goal`, recording each prompt it got."""

    def __init__(self, tok, actions):
        self.tok, self.actions, self.prompts, self.version = tok, list(actions), [], 0

    async def generate(self, ids, params, vision=None):
        self.prompts.append((list(ids), vision))
        a = self.actions.pop(0)
        out = self.tok(a, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [Completion(out, [-0.1] * len(out), [0] * len(out), "stop")]


def test_sft_rows_are_exactly_the_episode_at_that_turn():
    processor = build_vlm_processor()
    tok = processor.tokenizer
    attach_processor(tok, processor)
    rows = gui.sft_rows(9, 3)  # the steps of the first episodes (1 + 2 + 3 + 2 + 1 steps)
    by_goal: dict[int, list[dict]] = {}
    for r in rows:
        by_goal.setdefault(r["goal_seed"], []).append(r)
    for steps in by_goal.values():
        goal = steps[0]["goal"]
        engine = Expert(tok, gui.expert_actions(goal))
        ctx = RolloutContext(
            engine=engine,
            tokenizer=tok,
            sampling=SamplingParams(max_new_tokens=16),
            reward_fn=gui.success,
            encode=lambda r: [],
            extras={"agent": AgentConfig(max_turns=5, reward="task"), "vision": VisionConfig()},
        )
        row = {"goal": goal, "start": 0, "max_actions": 5}
        sample = asyncio.run(multi_turn.run_episode(ctx, row, gui.GuiEnv(), ctx.extras["agent"]))
        assert sample.status == Status.COMPLETED and sample.reward == 1.0
        assert sample.reward_info["env_rewards"] == [1.0] * len(steps)
        for sft, (ids, vision) in zip(steps, engine.prompts, strict=False):
            want_ids, want = encode_vision_prompt(processor, sft)
            assert ids == want_ids and vision.equal(want)
