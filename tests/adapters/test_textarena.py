"""textarena: a two-player game as a multi-agent episode, each player a role with its own policy;
both roles are trained on what the game says about them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import weir

ta = pytest.importorskip("textarena")

CONFIG = str(Path(__file__).parents[2] / "examples" / "textarena_nim.yaml")
# One round of rock-paper-scissors: both players act once, the game says who won.
RPS = [
    "textarena.env_id=IteratedRockPaperScissors-v0",
    "textarena.kwargs={num_rounds: 1}",
    "textarena.max_turns=4",
    "rollout.max_new_tokens=8",
    "multi_agent.max_tokens=220",
]
ROLES = {0: "first", 1: "second"}
PROMPTS = {"first": "you move first", "second": "you move second"}


def sft_rows(n: int) -> list[dict]:
    """Each player's first observation, as the rollout shows it (its role prompt, then what the
    game says), answered with a random valid move: a warm start that plays legal moves."""
    rng = random.Random(0)
    rows = []
    for seed in range(n):
        env = ta.make("IteratedRockPaperScissors-v0", num_rounds=1)
        env.reset(num_players=2, seed=seed)
        for _ in range(2):
            pid, obs = env.get_observation()
            move = rng.choice(["[r]", "[p]", "[s]"])
            role = ROLES[int(pid)]
            messages = [
                {"role": "system", "content": PROMPTS[role]},
                {"role": "user", "content": obs},
            ]
            rows.append({"messages": messages, "response": move})
            env.step(move)
        env.close()
    return rows


@pytest.mark.slow
def test_both_players_of_a_textarena_game_are_trained(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sft_rows(150)))
    sft = weir.sft(
        CONFIG,
        [
            f"run.dir={tmp_path / 'sft'}",
            f"sft.data={data}",
            "sft.epochs=4",
            "sft.batch_size=32",
            "sft.lr=3e-3",
            "multi_agent.policies=shared",
            *RPS,
        ],
    )
    result = weir.run(
        CONFIG,
        [
            f"run.dir={tmp_path / 'rl'}",
            f"model.path={sft}",
            "run.steps=3",
            "run.eval_every=0",
            "rollout.batch_prompts=4",
            "train.lr=2e-4",
            *RPS,
        ],
    )
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 3
    for h in steps:  # both players act in every step, and the game rewards them
        assert h["rollout/first/samples"] > 0 and h["rollout/second/samples"] > 0
        assert h["rollout/failed"] == 0
        assert h["mismatch/abs_logp_diff"] < 1e-4  # token-exact views
    # the game's own rewards: a zero-sum game (each episode's team reward, the players' mean, is
    # 0) in which someone won
    assert all(h["reward/team/mean"] == 0 for h in steps)
    assert any(h["reward/first/std"] > 0 for h in steps)
    # both policies moved: each role's own model differs from the warm start
    start = load_file(str(Path(sft) / "model.safetensors"))
    for role in ("first", "second"):
        trained = load_file(str(result.model_dir / role / "model.safetensors"))
        moved = [k for k in start if not torch.equal(start[k], trained[k])]
        assert moved, role
