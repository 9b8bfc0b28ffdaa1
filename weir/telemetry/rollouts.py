"""Optional rollout dumps: every trained sample of a step as one JSON line, for debugging."""

from __future__ import annotations

import json
from pathlib import Path

from weir.data.sample import Group


def dump_rollouts(path: str | Path, step: int, groups: list[Group]) -> Path:
    """Write `groups` to `path` (JSONL, one sample a line): ids, texts, reward, log-probs, versions.

    Rows keep only their JSON-serialisable fields; a field that is not is written as its repr.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for g in groups:
            for s in g.samples:
                record = {
                    "step": step,
                    "group_id": s.group_id,
                    "index": s.index,
                    "status": s.status.value,
                    "error": s.error,
                    "reward": s.reward,
                    "reward_info": s.reward_info,
                    "prompt_ids": s.prompt_ids,
                    "response_ids": s.response_ids,
                    "prompt_text": s.prompt_text,
                    "response_text": s.response_text,
                    "loss_mask": s.loss_mask,
                    "rollout_logprobs": s.rollout_logprobs,
                    "versions": s.versions,
                    "row": s.row,
                    "images": s.vision.images if s.vision is not None else [],
                }
                fh.write(json.dumps(record, default=repr) + "\n")
    return out
