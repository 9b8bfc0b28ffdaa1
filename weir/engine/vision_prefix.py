"""Cross-turn KV reuse for vision-language conversations: which images a cached prefix holds, and
where a prefill on top of cached prefixes may start.

An agent that looks at a screen each turn sends the engine the whole conversation again, images
included. The prefix cache (`weir.engine.prefix_cache`) keeps the KV of the previous turn; for it
to serve a vision-language request safely:

- an entry is keyed by its ids *and* the digests of the images among them (every image token is the
  same id, so the ids alone do not tell two screenshots apart);
- a request matches an entry only at a length that does not cut an image's tokens in two;
- the prefill computes the tokens after the prefix, and the vision tower runs only on the images
  whose tokens are among them (`weir.data.vision_model.VisionModel.suffix_inputs`); rows admitted
  together compute the same number of trailing columns, so that number is widened until no row's
  first computed column falls inside an image.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from weir.data.vision import VisionInputs
from weir.data.vision_spans import image_digests, image_spans

__all__ = ["images_of", "prompt_images", "widen_suffix"]


def images_of(
    prompt: Sequence[int], vision: VisionInputs | None, image_token_id: int
) -> Callable[[int], tuple[str, ...] | None]:
    """For `PrefixCache.take`: the digests of the images within the first `length` tokens of
    `prompt`, or None where `length` falls inside an image's tokens."""
    spans = image_spans(prompt, image_token_id)
    digests = image_digests(vision) if spans else []
    if len(digests) != len(spans):  # the engine's check refuses such a request before this
        raise ValueError(f"{len(spans)} image token runs for {len(digests)} images")

    def of(length: int) -> tuple[str, ...] | None:
        out = []
        for (a, b), d in zip(spans, digests, strict=True):
            if a < length < b:
                return None
            if b <= length:
                out.append(d)
        return tuple(out)

    return of


def prompt_images(vision: VisionInputs | None) -> tuple[str, ...]:
    """The digests of all the images of a prompt (what a finished turn's cache entry holds: its
    prompt and its sampled tokens, which are never image tokens)."""
    return tuple(image_digests(vision))


def widen_suffix(seqs: Sequence[Sequence[int]], q: int, image_token_id: int) -> int:
    """The smallest ``q' >= q`` such that no sequence's first computed column ``len(seq) - q'``
    falls strictly inside one of its images' tokens."""
    spans = [image_spans(s, image_token_id) for s in seqs]
    while True:
        wider = q
        for s, sp in zip(seqs, spans, strict=True):
            first = len(s) - q
            for a, b in sp:
                if a < first < b:
                    wider = max(wider, len(s) - a)
        if wider == q:
            return q
        q = wider
