"""One FSDP2 trainer rank for tests/train/test_distill_ranks.py, run as a process of its own:

    python tests/train/distill_rank.py RANK WORLD PORT MODEL_DIR TEACHER OUT_DIR

It starts a `TrainerRank` (the meta-device start, the teacher read shard by shard as the reference
is) with `algo.distill.teacher=TEACHER` (a model directory or a served teacher's URL), trains one
step of the toy batch and writes the step's metrics to OUT_DIR/rank<R>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.toy import toy_groups
from weir.config import build_config
from weir.train.batch import make_batch
from weir.train.distributed import RankSettings, TrainerRank

OPTS = ["rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-3", "model.threads=1"]
KEYS = ("train/loss", "train/grad_norm", "distill/reverse_kl", "distill/teacher_logp")


def main(rank: int, world: int, port: int, model_dir: str, teacher: str, out: Path) -> None:
    cfg = build_config({}, [*OPTS, f"algo.distill.teacher={teacher}"])
    trainer = TrainerRank(RankSettings.from_config(cfg), model_dir, rank, world)
    trainer.setup("127.0.0.1", port)
    stats = trainer.train(make_batch(toy_groups(), version=0))
    sharded = (
        type(trainer.actor.teacher.model).__name__
        if hasattr(trainer.actor.teacher, "model")
        else ""
    )
    result = {"stats": {k: stats[k] for k in KEYS}, "teacher_class": sharded}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    trainer.close()


if __name__ == "__main__":
    r, w, p, m, t, d = sys.argv[1:7]
    main(int(r), int(w), int(p), m, t, Path(d))
