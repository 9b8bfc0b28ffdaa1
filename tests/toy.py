"""Small hand-made data shared by tests (import as `from tests.toy import ...`)."""

from __future__ import annotations

import torch

from weir.data.sample import Group, Sample


def toy_groups(seed: int = 0):
    """Two prompts, four responses each, rewards 1 for the first two responses of each group."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gid in range(2):
        prompt = torch.randint(6, 200, (5,), generator=g).tolist()
        samples = []
        for i in range(4):
            resp = torch.randint(6, 200, (3 + i,), generator=g).tolist()
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=resp,
                    versions=[0] * len(resp),
                    reward=float(i < 2),
                    group_id=gid,
                    index=i,
                )
            )
        groups.append(Group(samples=samples, group_id=gid))
    return groups
