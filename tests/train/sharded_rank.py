"""One trainer rank for tests/train/test_sharded_checkpoint.py, run as a process of its own:

    python tests/train/sharded_rank.py RANK WORLD PORT MODEL_DIR WORK_DIR

It starts a `TrainerRank` (meta-device start), trains a step, writes a sharded checkpoint while
measuring its own memory, trains on, loads the checkpoint back, trains the same step again, and
writes the weights as an HF directory from the shards. What it saw goes to WORK_DIR/rank<R>.json
(and rank 0's gathered weights to WORK_DIR/full.pt, for comparison).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.memory_probe import AllocationPeak
from tests.toy import toy_groups
from weir.config import build_config
from weir.train.batch import make_batch
from weir.train.distributed import RankSettings, TrainerRank
from weir.train.memory import peak_rss_since, reset_peak_rss

OPTS = ["rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-3", "model.threads=1"]
KEYS = ("train/loss", "train/grad_norm", "train/lr", "policy/pg_loss")


def main(rank: int, world: int, port: int, model_dir: str, work: Path) -> None:
    cfg = build_config({}, OPTS)
    trainer = TrainerRank(RankSettings.from_config(cfg), model_dir, rank, world)
    trainer.setup("127.0.0.1", port)
    out: dict = {"start": trainer.start_stats()}
    out["layout_at_start"] = trainer.actor._layouts  # None: `auto` is resolved at the first forward
    batch = make_batch(toy_groups(), version=0)
    trainer.train(batch)  # the optimizer state exists from here on
    out["layout"] = trainer.actor.layout
    out["candidates"] = trainer.actor.layouts.candidates
    path = work / "ckpt" / "trainer"
    baseline = reset_peak_rss()
    with AllocationPeak() as probe:
        out["entries"] = trainer.save(str(path))
    out["save_rss_mb"] = peak_rss_since(baseline) / 2**20
    out["save_alloc_mb"] = probe.peak / 2**20
    out["state_mb"] = (
        sum(
            t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
            for p in trainer.actor.model.parameters()
            for t in [p, *trainer.actor.optimizer.state[p].values()]
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        / 2**20
    )
    again = trainer.train(batch)
    after = [p.to_local().clone() for p in trainer.actor.model.parameters()]
    trainer.load(str(path))
    repeat = trainer.train(batch)
    # the update after the load (it needs the restored Adam moments) equals the first one
    out["same_update"] = all(
        torch.equal(a, p.to_local())
        for a, p in zip(after, trainer.actor.model.parameters(), strict=True)
    )
    out["again"] = {k: again[k] for k in KEYS}
    out["repeat"] = {k: repeat[k] for k in KEYS}
    out["hf_files"] = trainer.save_hf(str(work / "hf"), bucket_mb=8.0)
    full = trainer.full_state()
    if rank == 0:
        torch.save(full, work / "full.pt")
    (work / f"rank{rank}.json").write_text(json.dumps(out))
    trainer.close()


if __name__ == "__main__":
    r, w, p, m, d = sys.argv[1:6]
    main(int(r), int(w), int(p), m, Path(d))
