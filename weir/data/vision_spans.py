"""Images inside a token sequence: where each image's tokens are, and the pixel inputs of a chosen
subset of images.

A vision-language conversation that grows turn by turn (an agent's screenshots) holds several
images; its `VisionInputs` lists them in the order their tokens appear. The engine's cross-turn KV
reuse prefills only the tokens after a cached prefix, so it needs the pixels of the images in that
suffix only, and it must tell two conversations with the same ids but other images apart (every
image token is the same ``<|image_pad|>`` id): each image gets a digest of its pixels.

Layout of Qwen2.5-VL / Qwen3-VL pixel inputs: ``image_grid_thw`` has one row per image (t, h, w in
patches); ``pixel_values`` one row per patch, image after image, ``t * h * w`` rows each.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from weir.data.vision import VisionInputs

__all__ = [
    "concat_vision",
    "image_digests",
    "image_spans",
    "patch_ranges",
    "select_images",
]

_DIGESTS = "_weir_digests"  # per-image digests cached on a VisionInputs object


def image_spans(ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of image tokens in `ids`, in order: one run per image (images
    are separated by their start/end markers, so two images never form one run)."""
    spans: list[tuple[int, int]] = []
    start = -1
    for i, t in enumerate(ids):
        if t == image_token_id:
            if start < 0:
                start = i
        elif start >= 0:
            spans.append((start, i))
            start = -1
    if start >= 0:
        spans.append((start, len(ids)))
    return spans


def patch_ranges(vision: VisionInputs) -> list[tuple[int, int]]:
    """``[start, end)`` rows of ``pixel_values`` that belong to each image."""
    grid = vision.tensors["image_grid_thw"]
    counts = grid.prod(-1).tolist()
    out, at = [], 0
    for n in counts:
        out.append((at, at + int(n)))
        at += int(n)
    return out


def select_images(vision: VisionInputs | None, keep: Sequence[int]) -> VisionInputs | None:
    """The pixel inputs of images `keep` (indices in order of appearance) of `vision`; None when
    none is kept. Per-image tensors (one row per image) and per-patch tensors (one row per patch)
    are sliced accordingly; anything else is refused."""
    if vision is None or not keep:
        return None
    keep = list(keep)
    ranges = patch_ranges(vision)
    if keep == list(range(len(ranges))):
        return vision
    n_images, n_patches = len(ranges), ranges[-1][1] if ranges else 0
    rows = torch.cat([torch.arange(*ranges[k]) for k in keep])
    tensors = {}
    for name, t in vision.tensors.items():
        if t.shape[0] == n_patches:  # (an image has at least merge**2 >= 4 patches: no clash)
            tensors[name] = t.index_select(0, rows)
        elif t.shape[0] == n_images:
            tensors[name] = t[keep]
        else:
            raise ValueError(
                f"pixel input {name!r} has {t.shape[0]} rows for {n_images} images of {n_patches} "
                "patches; weir cannot tell which rows belong to which image"
            )
    refs = [vision.images[k] for k in keep] if len(vision.images) == n_images else []
    out = VisionInputs(tensors, refs)
    digests = getattr(vision, _DIGESTS, None)
    if digests is not None:
        setattr(out, _DIGESTS, [digests[k] for k in keep])
    return out


def concat_vision(items: Sequence[VisionInputs | None]) -> VisionInputs | None:
    """One `VisionInputs` of several, images in the order given (None when there are none)."""
    present = [x for x in items if x is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    keys = list(present[0].tensors)
    for x in present:
        if list(x.tensors) != keys:
            raise ValueError(
                f"images with different pixel inputs in one conversation: {keys} vs "
                f"{list(x.tensors)}"
            )
    out = VisionInputs(
        {k: torch.cat([x.tensors[k] for x in present]) for k in keys},
        [ref for x in present for ref in x.images],
    )
    cached = [getattr(x, _DIGESTS, None) for x in present]
    if all(d is not None for d in cached):
        setattr(out, _DIGESTS, [d for ds in cached for d in ds])
    return out


def image_digests(vision: VisionInputs | None) -> list[str]:
    """A digest of each image's pixel inputs (its grid and its patch rows), cached on `vision`."""
    if vision is None:
        return []
    cached = getattr(vision, _DIGESTS, None)
    if cached is not None:
        return cached
    grid = vision.tensors["image_grid_thw"]
    pixels = vision.tensors.get("pixel_values")
    out = []
    for k, (lo, hi) in enumerate(patch_ranges(vision)):
        h = hashlib.blake2b(digest_size=16)
        h.update(grid[k].cpu().numpy().tobytes())
        if pixels is not None:
            h.update(pixels[lo:hi].detach().cpu().contiguous().numpy().tobytes())
        out.append(h.hexdigest())
    setattr(vision, _DIGESTS, out)
    return out
