"""Images in multi-turn episodes: a vision-language model's prompt and observations through its own
processor, the episode's image memory, and the samples a trajectory becomes.

`EpisodeImages` serves one episode of `weir.rollout.multi_turn` for a vision-language model:

- **Encoding.** The first prompt (the environment's reset observation, or the row) and every
  observation that carries images are rendered by the model's chat template (an image part is the
  template's placeholder) and expanded by the processor into the model's own image tokens and
  pixels, once. An image observation is a ``user`` turn (where vision-language chat templates
  render images): its ids are the template's text from the end of the model's turn to the next
  assistant header, as for a text observation (`weir.rollout.multi_turn.ObservationCodec`, whose
  ``tool`` turn text-only observations keep). Ids are never re-tokenized afterwards.
- **What the engine sees.** Every turn the engine gets the conversation so far and the pixels of
  the images in it (`context`), so it prefills them with their pixels and, with the built-in
  engine's prefix cache, reuses the previous turn's KV (`weir.engine.vision_prefix`).
- **Memory** (``vision.episode_memory``; the bound ``vision.max_image_tokens``):

  - ``keep``: every image stays in the context. An observation whose images would take the context
    over ``max_image_tokens`` image tokens ends the episode (``truncated``, stop ``image_tokens``).
  - ``drop``: only the newest ``vision.keep_images`` images stay (fewer when they would exceed
    ``max_image_tokens``); an older one's tokens (``<|vision_start|>``, its image tokens,
    ``<|vision_end|>``) are replaced by the ids of ``vision.image_placeholder`` (e.g. ``[image]``).
  - ``summary``: as ``drop``, but an image is replaced by its observation's ``summary`` text (the
    environment's own words for that screen, `weir.rollout.observation.Observation`), or by the
    placeholder where it gave none.

  So a context holds at most ``max_image_tokens`` image tokens (and, under ``drop``/``summary``, at
  most ``keep_images`` images); ``agent.max_tokens`` bounds the episode's response tokens.
- **Segments.** Replacing an image rewrites the context the model saw before, so a trajectory
  with replacements cannot be one sample (the trainer must see each token with the context it was
  sampled in). It becomes one sample per *segment*: a segment starts at the model turn after a
  rewrite, its prompt is the rewritten context, its response the turns (and observations between
  them) until the next rewrite. Each model token is trained exactly once, with the ids and pixels
  the engine had. Segment samples share the episode's reward and carry ``metadata`` ``episode``,
  ``segment``, ``segments``, ``turn_offset`` (model turns before the segment) and their ``turns``.
  Under ``keep`` an episode is one segment, hence one sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from weir.data.prompts import PromptTooLong
from weir.data.sample import Sample, Status
from weir.data.vision import VisionInputs, process_vision_text, processor_of, vision_messages
from weir.data.vision_spans import concat_vision, image_spans, select_images
from weir.rollout.observation import ChatMessages, Observation, as_observation

__all__ = ["EpisodeImages", "episode_images", "split_segments", "vision_extras"]

_MARK_A = "\x00weir-assistant\x00"
PLACEHOLDER_ERROR = "the response emitted an image placeholder token (no pixels behind it)"


@dataclass
class _Image:
    start: int  # raw position of the image's first token (its start marker when it has one)
    end: int  # raw position after its last token (its end marker when it has one)
    tokens: int  # image tokens
    vision: VisionInputs  # this image's pixel inputs alone
    stand_in: list[int]  # ids that replace it once dropped


@dataclass
class _Segment:
    start: int  # raw position of the segment's first response token
    dropped: frozenset[int]  # images replaced in its context
    end: int | None = None  # raw position where its response ends (None: the episode's end)


@dataclass
class EpisodeImages:
    """One episode's images (see the module docstring). `memory` is the `vision` config section."""

    processor: Any
    memory: Any
    images: list[_Image] = field(default_factory=list)
    dropped: set[int] = field(default_factory=set)
    segments: list[_Segment] = field(default_factory=list)
    stop: str = ""
    prompt_length: int = 0

    def __post_init__(self) -> None:
        tok = self.processor.tokenizer
        self.tokenizer = tok
        self.image_token_id = int(self.processor.image_token_id)
        self.placeholders = {self.image_token_id, int(self.processor.video_token_id)}
        vocab = tok.get_vocab()
        self.start_id = vocab.get("<|vision_start|>")
        self.end_id = vocab.get("<|vision_end|>")
        self.placeholder_ids = self._encode(self.memory.image_placeholder)

    # -- encoding -----------------------------------------------------------------------------------

    def encode_prompt(
        self,
        row: dict,
        first: Any,
        tools: list[dict] | None,
        prompt: dict[str, Any],
        encode_row: Any,
    ) -> list[int]:
        """The episode's prompt ids: `encode_row(row)` (the run's prompt encoder, row images
        included) when the environment's reset gave nothing and no tools are shown, else the chat
        template over the reset observation (a string, an `Observation`, or chat messages whose
        content may hold image parts) with `tools`; its images are the episode's first."""
        if first is None and not tools:
            ids, vision = encode_row(row)
        else:
            ids, vision = self._encode_chat(row, first, tools, prompt)
        self._register(ids, 0, vision)
        self.prompt_length = len(ids)
        self.segments = [_Segment(len(ids), frozenset())]
        return ids

    def observation(self, value: Any, at: int, room: int, codec: Any) -> list[int] | None:
        """The ids of observation `value` appended at raw position `at`; None (and `stop` set)
        when it does not fit: the episode's `room` response tokens, or, under ``keep``, the image
        token bound. A text observation is encoded by `codec` (its tool turn); one with images
        goes through the processor, and the memory policy may then drop older images, which opens
        a new segment after this observation."""
        obs = as_observation(value)
        if isinstance(obs, (str, ChatMessages)):
            ids = codec.encode(obs)
            if len(ids) >= room:
                self.stop = "max_tokens"
                return None
            return ids
        ids, vision = self._encode_observation(obs)
        if len(ids) >= room:
            self.stop = "max_tokens"
            return None
        new = self._images_in(ids, at, vision, obs.summary)
        kept = [k for k in range(len(self.images)) if k not in self.dropped]
        dropped = self._policy(kept, new)
        if dropped is None:
            self.stop = "image_tokens"
            return None
        self.images += new
        if dropped - self.dropped:
            self.segments[-1].end = at
            self.dropped = dropped
            self.segments.append(_Segment(at + len(ids), frozenset(dropped)))
        return ids

    def emitted_placeholder(self, token_ids: list[int]) -> bool:
        """Whether a model turn contains an image placeholder (no pixels stand behind it: the
        episode fails there, as a single-turn response does)."""
        return bool(self.placeholders.intersection(token_ids))

    # -- what the engine sees -----------------------------------------------------------------------

    def context(self, raw: list[int]) -> tuple[list[int], VisionInputs | None]:
        """The ids and pixels the engine gets for the raw conversation `raw` (prompt + response so
        far): dropped images replaced by their stand-ins, the others' pixels in order."""
        return self._rewrite(raw, self.dropped), self._vision(len(raw), self.dropped)

    def engine_kwargs(self, vision: VisionInputs | None) -> dict[str, Any]:
        return {} if vision is None else {"vision": vision}

    # -- samples ------------------------------------------------------------------------------------

    def finish(self, sample: Sample) -> Sample:
        """Attach the episode's pixels to its raw trajectory `sample` (all its images, in order)
        and, when the context was rewritten, the segments `split_segments` makes samples of:
        ``metadata["segments"]``, one ``{"start", "end", "prompt_ids", "images"}`` per segment
        (raw positions, the rewritten prompt, the images its context keeps)."""
        raw = sample.prompt_ids + sample.response_ids
        sample.vision = self._vision(len(raw), frozenset())
        if len(self.segments) > 1:
            sample.metadata["segments"] = [
                {
                    "start": seg.start,
                    "end": len(raw) if seg.end is None else min(seg.end, len(raw)),
                    "prompt_ids": self._rewrite(raw[: seg.start], seg.dropped),
                    "images": [  # (index, raw end) of each image its context keeps
                        [k, img.end]
                        for k, img in enumerate(self.images)
                        if k not in seg.dropped and img.end <= len(raw)
                    ],
                }
                for seg in self.segments
                if seg.start < len(raw)
            ]
        return sample

    # -- internals ----------------------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _encode_chat(
        self, row: dict, first: Any, tools: list[dict] | None, prompt: dict[str, Any]
    ) -> tuple[list[int], VisionInputs | None]:
        key = prompt.get("prompt_key", "prompt")
        if first is None:  # the row's prompt and images, with the tools shown
            source = row
        elif (
            isinstance(first, list) and first and isinstance(first[0], dict) and "role" in first[0]
        ):
            source = {"messages": first}
        else:
            obs = as_observation(first, "env.reset")
            content = obs if isinstance(obs, str) else obs.parts()
            source = {"messages": [{"role": "user", "content": content}]}
        messages, images, refs = vision_messages(
            source,
            prompt_key=key,
            image_key=self.memory.image_key,
            system_prompt=prompt.get("system_prompt"),
            allow_remote=self.memory.allow_remote_urls,
        )
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=True
        )
        ids, vision = self._process(text, images, refs)
        limit = prompt.get("max_prompt_tokens")
        if limit is not None and len(ids) > limit:
            raise PromptTooLong(len(ids), limit, row.get("_index"))
        return ids, vision

    def _encode_observation(self, obs: Observation) -> tuple[list[int], VisionInputs | None]:
        """The template's text from the end of the model's turn through a user turn holding the
        observation to the next assistant header, expanded by the processor."""
        messages, images, refs = vision_messages(
            {"messages": [{"role": "user", "content": obs.parts()}]},
            allow_remote=self.memory.allow_remote_urls,
        )
        chat = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": _MARK_A},
            *messages,
        ]
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        start = text.index(_MARK_A) + len(_MARK_A)
        eos = self.tokenizer.eos_token or ""
        if eos and text.startswith(eos, start):  # the model's own turn ends with it (sampled)
            start += len(eos)
        return self._process(text[start:], images, refs)

    def _process(
        self, text: str, images: list[Any], refs: list[str]
    ) -> tuple[list[int], VisionInputs | None]:
        return process_vision_text(self.processor, text, images, refs, add_special_tokens=False)

    def _register(self, ids: list[int], at: int, vision: VisionInputs | None) -> None:
        self.images += self._images_in(ids, at, vision, None)

    def _images_in(
        self, ids: list[int], at: int, vision: VisionInputs | None, summary: str | None
    ) -> list[_Image]:
        """The images of `ids` (placed at raw position `at`), each with its own pixels."""
        spans = image_spans(ids, self.image_token_id)
        if vision is None or not spans:
            return []
        stand_in = self.placeholder_ids
        if summary is not None and self.memory.episode_memory == "summary":
            stand_in = self._encode(summary)
        out = []
        for k, (a, b) in enumerate(spans):
            lo = a - 1 if a > 0 and ids[a - 1] == self.start_id else a
            hi = b + 1 if b < len(ids) and ids[b] == self.end_id else b
            one = select_images(vision, [k])
            assert one is not None
            out.append(_Image(at + lo, at + hi, b - a, one, stand_in))
        return out

    def _policy(self, kept: list[int], new: list[_Image]) -> set[int] | None:
        """The images dropped once `new` joins the context (indices into the episode's images), or
        None when the observation cannot be shown (``keep`` over the bound, or its own images alone
        over it)."""
        bound = self.memory.max_image_tokens
        new_tokens = sum(img.tokens for img in new)
        if new_tokens > bound:
            return None
        dropped = set(self.dropped)
        if self.memory.episode_memory == "keep":
            total = sum(self.images[k].tokens for k in kept) + new_tokens
            return None if total > bound else dropped
        limit = self.memory.keep_images
        order = list(kept)
        while order and (
            len(order) + len(new) > limit
            or sum(self.images[k].tokens for k in order) + new_tokens > bound
        ):
            dropped.add(order.pop(0))  # the oldest first
        return dropped

    def _rewrite(self, raw: list[int], dropped: frozenset[int] | set[int]) -> list[int]:
        if not dropped:
            return list(raw)
        out: list[int] = []
        at = 0
        for k in sorted(dropped):
            img = self.images[k]
            if img.end > len(raw):
                continue
            out += raw[at : img.start] + img.stand_in
            at = img.end
        return out + raw[at:]

    def _vision(self, length: int, dropped: frozenset[int] | set[int]) -> VisionInputs | None:
        return concat_vision(
            [
                img.vision
                for k, img in enumerate(self.images)
                if k not in dropped and img.end <= length
            ]
        )


def split_segments(sample: Sample) -> list[Sample]:
    """The training samples of an episode's raw trajectory `sample`: itself when its context was
    never rewritten, else one sample per segment (``metadata["segments"]``, set by
    `EpisodeImages.finish`; see the module docstring). A segment's sample keeps the images of its
    context (and of its response) that lie before its end; segments without a model token are left
    out. Each carries ``metadata`` ``segment``, ``segments``, ``turn_offset`` and its ``turns``."""
    segs = sample.metadata.get("segments")
    if not segs:
        sample.metadata.update({"segment": 0, "segments": 1, "turn_offset": 0})
        return [sample]
    p = len(sample.prompt_ids)
    raw = sample.prompt_ids + sample.response_ids
    turns = sample.metadata.get("turns") or []
    out: list[Sample] = []
    for k, seg in enumerate(segs):
        start, end = seg["start"], seg["end"]
        lo, hi = start - p, end - p
        if end <= start or not any(sample.loss_mask[lo:hi]):
            continue
        mine, before, pos = [], 0, p
        for t in turns:
            if start <= pos and pos + t["tokens"] <= end:
                mine.append(t)
            elif pos < start and t["role"] == "assistant":
                before += 1
            pos += t["tokens"]
        last = k == len(segs) - 1
        behavior = sample.behavior_logprobs
        keep = [k for k, image_end in seg["images"] if image_end <= end]
        meta = {key: v for key, v in sample.metadata.items() if key != "segments"}
        out.append(
            replace(
                sample,
                prompt_ids=list(seg["prompt_ids"]),
                response_ids=raw[start:end],
                loss_mask=sample.loss_mask[lo:hi],
                rollout_logprobs=sample.rollout_logprobs[lo:hi],
                behavior_logprobs=None if behavior is None else behavior[lo:hi],
                versions=sample.versions[lo:hi],
                status=sample.status if last else Status.COMPLETED,
                error=sample.error if last else None,
                reward_info=dict(sample.reward_info),
                metadata={**meta, "turns": mine, "segment": len(out), "turn_offset": before},
                vision=select_images(sample.vision, keep),
            )
        )
    for s in out:
        s.metadata["segments"] = len(out)
    return out


def episode_images(ctx: Any) -> EpisodeImages | None:
    """An `EpisodeImages` for one episode when the run's model takes images, else None."""
    processor = processor_of(ctx.tokenizer)
    if processor is None:
        return None
    memory = ctx.extras.get("vision")
    if memory is None:
        from weir.config.schema import VisionConfig

        memory = VisionConfig()
    return EpisodeImages(processor, memory)


def vision_extras(cfg: Any) -> dict[str, Any]:
    """What `episode_images` reads from ``ctx.extras``: the `vision` config section."""
    return {"vision": cfg.vision}
