"""One FSDP2 trainer rank for tests/train/test_sharded_shortcuts.py, run as a process of its own:

    python tests/train/shortcut_rank.py RANK WORLD PORT MODEL_DIR OUT_DIR

It trains the same batch (one group with equal rewards: dead rows) four ways from the same
initial weights, two steps each and then a step on a batch of dead rows only: the full step (no
shortcuts), the default step (fused old log-probs, dead rows without forward or backward), the
step with `train.dead_rows=forward` (dead rows run a forward without gradients, before the
gradient micro-batches), and the default step with rank 1 alone meeting a non-finite log-prob in
its first micro-batch (every rank must restart the step together).
What it saw goes to OUT_DIR/rank<R>.json, and the gathered weights of each way to
OUT_DIR/<way>.pt on rank 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import weir.train.actor as actor_module
from weir.config import build_config
from weir.data.sample import Group, Sample
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.sharded_actor import ShardedActor

OPTS = [
    "rollout.batch_prompts=3",
    "rollout.n=4",
    "train.lr=1e-2",
    "train.micro_batch_tokens=24",
    "train.packing=padded",
    "algo.old_logprobs=recompute",
]
KEYS = ("train/loss", "policy/pg_loss", "train/grad_norm", "train/entropy")


def groups(all_dead: bool = False) -> list[Group]:
    """Three prompts of four responses of uneven lengths; the last group's rewards are all equal,
    so its rows have zero advantage (dead rows); with `all_dead`, every group's are."""
    g = torch.Generator().manual_seed(3)
    out = []
    for gid, lengths in enumerate([[30, 3, 4, 5], [6, 2, 7, 3], [4, 9, 2, 5]]):
        prompt = torch.randint(6, 200, (5,), generator=g).tolist()
        samples = [
            Sample(
                prompt_ids=prompt,
                response_ids=torch.randint(6, 200, (n,), generator=g).tolist(),
                versions=[0] * n,
                reward=1.0 if gid == 2 or all_dead else float(i % 2 == 0),
                group_id=gid,
                index=i,
            )
            for i, n in enumerate(lengths)
        ]
        out.append(Group(samples=samples, group_id=gid))
    return out


class Spy:
    """Counts the actor's separate log-prob passes and its forwards with and without gradients."""

    def __init__(self, actor: ShardedActor) -> None:
        self.logprob_passes = self.grad_forwards = self.nograd_forwards = 0
        logprobs, forward = actor.logprobs, actor._forward

        def counted_logprobs(*a, **k):
            self.logprob_passes += 1
            return logprobs(*a, **k)

        def counted_forward(*a, **k):
            if torch.is_grad_enabled():
                self.grad_forwards += 1
            else:
                self.nograd_forwards += 1
            return forward(*a, **k)

        actor.logprobs, actor._forward = counted_logprobs, counted_forward


def run(way: str, model_dir: str, rank: int, out: Path) -> dict:
    torch.manual_seed(0)
    opts = OPTS + (["train.dead_rows=forward"] if way == "forward" else [])
    if way == "prefix":
        opts = [o for o in opts if not o.startswith("train.packing")] + ["train.packing=prefix"]
    actor = ShardedActor(
        AutoModelForCausalLM.from_pretrained(model_dir),
        ActorSettings.from_config(build_config({}, opts)),
    )
    if way == "full":
        actor.fuses_old_logprobs = actor.skips_dead_backward = False
    spy = Spy(actor)
    real_finite = actor_module.finite_flag
    calls = {"n": 0}
    if way == "injected" and rank == 1:

        def finite_once_not(*a, **k):  # rank 1's first micro-batch reads as non-finite
            calls["n"] += 1
            return real_finite(*a, **k) & (calls["n"] > 1)

        actor_module.finite_flag = finite_once_not
    batch = make_batch(groups(), version=0)
    stats = [actor.train(batch) for _ in range(2)]
    actor.train(make_batch(groups(all_dead=True), version=0))  # AdamW steps on a zero gradient
    actor_module.finite_flag = real_finite
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(
        actor.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save(full, out / f"{way}.pt")
    return {
        "stats": [{k: s[k] for k in KEYS} for s in stats],
        "layout": actor.layout,
        "logprob_passes": spy.logprob_passes,
        "grad_forwards": spy.grad_forwards,
        "nograd_forwards": spy.nograd_forwards,
    }


def one_process(model_dir: str, out: Path, packing: str) -> None:
    """The steps of `packing` in this one process, unsharded: what the ranks must match."""
    torch.manual_seed(0)
    opts = [o for o in OPTS if not o.startswith("train.packing")] + [f"train.packing={packing}"]
    actor = Actor(
        AutoModelForCausalLM.from_pretrained(model_dir),
        ActorSettings.from_config(build_config({}, opts)),
    )
    batch = make_batch(groups(), version=0)
    for _ in range(2):
        actor.train(batch)
    actor.train(make_batch(groups(all_dead=True), version=0))
    torch.save(
        {k: v.detach().clone() for k, v in actor.model.state_dict().items()},
        out / f"{packing}_one.pt",
    )


def main(rank: int, world: int, port: int, model_dir: str, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    seen = {
        way: run(way, model_dir, rank, out)
        for way in ("full", "default", "forward", "injected", "prefix")
    }
    if rank == 0:
        one_process(model_dir, out, "prefix")
        one_process(model_dir, out, "padded")
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5]))
