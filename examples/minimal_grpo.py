"""GRPO end to end on one screen: weir's pieces called one after another, nothing hidden.

    prompts -> engine (n responses each) -> reward -> batch -> trainer (advantages, loss, AdamW)
            -> weights back to the engine -> next step

`weir train` (weir/loop/sync.py) runs these same calls with a run directory, metrics, checkpoints,
evaluation schedules and placement on Ray around them; this file leaves all that out so the flow
reads top to bottom. docs/concepts/flow.md walks through it.

    python examples/minimal_grpo.py                # SFT warm start of the tiny model, then GRPO
    python examples/minimal_grpo.py --model DIR    # start from a model directory instead

On a 2-core CPU: about a minute of SFT, then 20 GRPO steps in under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from functools import partial
from pathlib import Path

import torch

import weir
from weir.algo import compute_advantages
from weir.config.schema import AlgoConfig, TrainConfig
from weir.data.prompts import encode_prompt
from weir.engine import SamplingParams, TorchEngine
from weir.rollout import collect_groups, evaluate, get_reward, rollout
from weir.rollout.single_turn import RolloutContext
from weir.tasks import get_task
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.model import eos_token_ids, load_model

WARM_START = Path(__file__).with_name("arithmetic_quick.yaml")  # weir.sft's config: see below


def grpo(model_path: str, steps: int = 20, prompts: int = 32, n: int = 8, seed: int = 0) -> dict:
    """GRPO on one-digit additions; returns held-out greedy accuracy before and after."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)

    # The policy, and an engine that decodes on the trainer's own module (one process, in turn).
    model, tokenizer = load_model(model_path)
    engine = TorchEngine(
        model, eos_token_ids=eos_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id
    )

    # The trainer: group-relative advantages, PPO's clipped loss, AdamW. Its settings are the
    # `train` and `algo` sections a YAML config would hold (docs/configuration.md).
    trainer = Actor(
        model,
        ActorSettings(
            train=TrainConfig(lr=5e-5, warmup_steps=2),
            algo=AlgoConfig(advantage="grpo", policy_loss="ppo", old_logprobs="engine"),
            total_steps=steps,
            max_response_tokens=4,
        ),
    )

    # Data and reward: a built-in task's rows ({"prompt", "answer"}) and its reward function.
    task = get_task("arithmetic")
    train_rows = task.make_rows("train", steps * prompts, seed, digits=1)
    test_rows = task.make_rows("test", 100, seed + 10_000, digits=1)
    ctx = RolloutContext(
        engine=engine,
        tokenizer=tokenizer,
        sampling=SamplingParams(n=n, temperature=1.0, max_new_tokens=4),
        reward_fn=get_reward(task.reward),
        encode=partial(encode_prompt, tokenizer),  # the chat template, as the SFT saw it
    )
    greedy = ctx.with_sampling(n=1, temperature=0.0)
    before = evaluate(greedy, test_rows, rollout)[0]["eval/accuracy"]

    for step in range(steps):
        rows = train_rows[step * prompts : (step + 1) * prompts]
        # 1. Rollout: n responses per prompt from the engine, each scored by the reward.
        groups, gen = collect_groups(ctx, rows, rollout)
        # 2. One batch of token ids, masks, the engine's log-probs and each token's version.
        batch = make_batch(groups, version=step)
        # 3. Train. The trainer computes these advantages itself; a group whose n rewards are
        #    all equal has advantage 0 everywhere and teaches nothing.
        adv = compute_advantages("grpo", batch.rewards, batch.response_mask, batch.group_ids)
        signal = (adv.advantages != 0).any(dim=1).float().mean().item()
        stats = trainer.train(batch)
        # 4. Sync: the new weights reach the engine as version step + 1.
        asyncio.run(engine.update_weights(trainer.weights(), version=step + 1))
        print(
            f"step {step + 1:2d}  reward {gen['reward/mean']:.3f}  samples with signal "
            f"{signal:.0%}  clipped {stats['policy/clipfrac_high']:.3f}  |grad| {stats['train/grad_norm']:.3f}"
        )

    after = evaluate(greedy, test_rows, rollout)[0]["eval/accuracy"]
    engine.close()
    return {"accuracy_before": before, "accuracy_after": after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: SFT the tiny model first)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = args.model
    if model is None:  # a tiny model SFT'd on answers 70% wrong: weak greedy, right when sampling
        out = Path(tempfile.mkdtemp(prefix="minimal_grpo_"))
        model = str(weir.sft(WARM_START, [f"run.dir={out}", f"run.seed={args.seed}"]))
    result = grpo(model, steps=args.steps, seed=args.seed)
    print(
        f"held-out greedy accuracy: {result['accuracy_before']:.0%} -> {result['accuracy_after']:.0%}"
    )


if __name__ == "__main__":
    main()
