"""One session's recorded calls (`Turn`s) and how they become training `Sample`s.

A session's turns are linked into segments. A turn *extends* the segment when its prompt starts with
the previous turn's prompt + response tokens, token for token; the tokens after that prefix are the
non-policy tokens of this turn (tool results, user messages, the chat template's turn markers). A
turn whose prompt does not extend (the agent edited its history, or restarted) opens a new segment.

A segment becomes one `Sample`:

    prompt_ids   = the first turn's prompt
    response_ids = r_1 + x_2 + r_2 + ... + x_k + r_k     (r_i sampled, x_i appended by the client)
    loss_mask    = 1 on every r token, 0 on every x token
    rollout_logprobs / versions: the engine's values on r tokens, 0.0 / -1 on x tokens

so the trainer sees exactly the token sequence the engine conditioned on at every turn. A
vision-language session's sample carries the pixels of the segment's last prompt (which holds every
image of the segment, in order: `weir.serve.vision_chat`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weir.data.sample import Sample, Status
from weir.data.vision import VisionInputs

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass
class Turn:
    """One model call: the prompt the engine was given and what it sampled."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    segment: int = 0
    link: str = "start"  # "start" (first turn), "extend", or "new: <why>" (a new segment)
    messages: list[dict[str, Any]] | None = None  # chat history the client sent, if a chat call
    output: dict[str, Any] = field(default_factory=dict)  # what the client received
    sampled_logprobs: list[float] | None = None  # under top-k/top-p truncation (see engine.base)
    vision: VisionInputs | None = None  # the prompt's pixels: every image of the segment so far

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def extends(prompt_ids: list[int], context: list[int]) -> bool:
    """True when `prompt_ids` is `context` followed by at least one more token."""
    return len(prompt_ids) > len(context) and prompt_ids[: len(context)] == context


def segments(turns: list[Turn]) -> list[list[Turn]]:
    """Group turns by segment, in order."""
    out: dict[int, list[Turn]] = {}
    for t in turns:
        out.setdefault(t.segment, []).append(t)
    return [out[k] for k in sorted(out)]


def segment_sample(turns: list[Turn], **fields: Any) -> Sample:
    """The `Sample` of one segment (see the module docstring). Raises ValueError if a turn does not
    extend the one before it (the server never records such a segment)."""
    if not turns:
        raise ValueError("a segment needs at least one turn")
    first = turns[0]
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    behavior: list[float] = []
    versions: list[int] = []
    context = list(first.prompt_ids)
    for i, t in enumerate(turns):
        if i:
            if not extends(t.prompt_ids, context):
                raise ValueError(f"turn {i} of the segment does not extend the previous turn")
            added = t.prompt_ids[len(context) :]
            response += added
            mask += [0] * len(added)
            logprobs += [0.0] * len(added)
            behavior += [0.0] * len(added)
            versions += [-1] * len(added)
        response += t.response_ids
        mask += [1] * len(t.response_ids)
        logprobs += list(t.logprobs)
        behavior += list(t.logprobs if t.sampled_logprobs is None else t.sampled_logprobs)
        versions += list(t.versions)
        context = t.context
    status = FINISH_STATUS.get(turns[-1].finish_reason, Status.COMPLETED)
    return Sample(
        prompt_ids=list(first.prompt_ids),
        response_ids=response,
        loss_mask=mask,
        rollout_logprobs=logprobs,
        behavior_logprobs=behavior if any(t.sampled_logprobs is not None for t in turns) else None,
        versions=versions,
        status=status,
        vision=turns[-1].vision,  # the last prompt holds every image of the segment
        **fields,
    )
