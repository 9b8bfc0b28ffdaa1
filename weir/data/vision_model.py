"""How a vision-language model takes a prompt's pixels and positions, in one place for the engine's
prefill and the trainer's forward, so that both build exactly the same model inputs.

Qwen2.5-VL rotates queries and keys by multimodal rotary positions (M-RoPE): three position ids per
token (temporal, height, width). A text token has all three equal to its 1-D position; the tokens
of an image get ``start + (t, h, w)`` over the image's merged patch grid, and the text after the
image continues from ``start + max(h, w)``. So after the prompt the next position is not the
prompt's length but ``len(prompt) + delta`` with

    delta = max(prompt positions) + 1 - len(prompt)        (the model's "rope delta", <= 0)

and every decoded token t (0-based) sits at ``len(prompt) + delta + t`` on all three axes. The
engine records that start per row; decode then passes 1-D positions, which the model expands to
three equal rows.

Positions are computed per sequence, by the model's own ``get_rope_index`` on that sequence alone,
then laid out as the caller's batch layout needs (left-padded rows, or one packed row).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weir.data.vision import VisionInputs
from weir.data.vision_spans import image_spans, select_images

__all__ = ["VisionModel", "vision_model"]

MROPE_TYPES = ("qwen2_5_vl", "qwen3_vl")
"""Architectures whose vision path weir drives exactly (docs/multimodal.md)."""


class VisionModel:
    """The pixel inputs and M-RoPE positions of a Qwen2.5-VL-style model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        self.model_type = str(config.model_type)
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = int(getattr(config, "video_token_id", -1))
        self.merge = int(config.vision_config.spatial_merge_size)
        base = getattr(model, "model", model)
        if not hasattr(base, "get_rope_index"):
            raise ValueError(f"{type(model).__name__} has no get_rope_index (not an M-RoPE model)")
        self._rope_index = base.get_rope_index
        self.device = next(model.parameters()).device

    def positions(
        self, ids: Sequence[int], vision: VisionInputs | None
    ) -> tuple[torch.Tensor, int]:
        """The (3, L) M-RoPE positions of one sequence and its rope delta (0 without images)."""
        n = len(ids)
        if vision is None:
            return torch.arange(n, device=self.device).expand(3, n), 0
        t = torch.tensor([list(ids)], device=self.device)
        types = (t == self.image_token_id).int() + 2 * (t == self.video_token_id).int()
        grid = vision.tensors.get("image_grid_thw")
        with torch.no_grad():
            pos, delta = self._rope_index(
                t,
                mm_token_type_ids=types,
                image_grid_thw=None if grid is None else grid.to(self.device),
            )
        return pos[:, 0], int(delta.reshape(-1)[0])

    def check(self, ids: Sequence[int], vision: VisionInputs | None) -> None:
        """Raise ValueError when the prompt's image tokens do not match its pixel inputs."""
        n_tok = sum(1 for i in ids if i == self.image_token_id)
        if vision is None:
            if n_tok:
                raise ValueError(f"the prompt has {n_tok} image tokens but no pixel inputs")
            return
        grid = vision.tensors.get("image_grid_thw")
        if grid is None:
            raise ValueError("pixel inputs without image_grid_thw")
        # the vision tower merges spatial_merge_size**2 patches into one token
        expected = int(grid.prod(-1).sum()) // self.merge**2
        if n_tok != expected:
            raise ValueError(
                f"the prompt has {n_tok} image tokens for {expected} merged image patches; encode "
                "it with the model's own processor"
            )

    def padded_inputs(
        self,
        seqs: Sequence[Sequence[int]],
        visions: Sequence[VisionInputs | None],
        width: int,
        dtype: torch.dtype | None = None,
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Forward kwargs for `seqs` left-padded to `width`: ``position_ids`` (3, B, width), padding
        at position 0, and the pixel tensors of every sequence with images, in row order; plus each
        sequence's rope delta."""
        pos = torch.zeros(3, len(seqs), width, dtype=torch.long, device=self.device)
        deltas = []
        for i, (s, v) in enumerate(zip(seqs, visions, strict=True)):
            p, d = self.positions(s, v)
            pos[:, i, width - len(s) :] = p
            deltas.append(d)
        kwargs = self._pixels(visions, dtype)
        kwargs["position_ids"] = pos
        return kwargs, deltas

    def suffix_inputs(
        self,
        seqs: Sequence[Sequence[int]],
        visions: Sequence[VisionInputs | None],
        width: int,
        q: int,
        dtype: torch.dtype | None = None,
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """`padded_inputs` for the last `q` of `width` columns only (a prefill on top of cached
        prefixes, `weir.engine.prefix_cache`): the positions of those columns, computed over the
        whole sequences, and the pixels of the images whose tokens lie in them (the earlier images
        are already in the cached KV). Raises ValueError when an image's tokens straddle a row's
        first computed column: the caller computes more columns instead."""
        pos = torch.zeros(3, len(seqs), width, dtype=torch.long, device=self.device)
        deltas, kept = [], []
        for i, (s, v) in enumerate(zip(seqs, visions, strict=True)):
            p, d = self.positions(s, v)
            pos[:, i, width - len(s) :] = p
            deltas.append(d)
            first = len(s) - q
            spans = image_spans(s, self.image_token_id)
            if any(a < first < b for a, b in spans):
                raise ValueError(f"an image's tokens straddle column {first} of a prefill")
            kept.append(select_images(v, [k for k, (a, _) in enumerate(spans) if a >= first]))
        kwargs = self._pixels(kept, dtype)
        kwargs["position_ids"] = pos[:, :, width - q :]
        return kwargs, deltas

    def packed_inputs(
        self,
        seqs: Sequence[Sequence[int]],
        visions: Sequence[VisionInputs | None],
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:
        """Forward kwargs for `seqs` packed into one row: ``position_ids`` (4, 1, L), the 1-D text
        positions restarting per sequence first (HF builds the block-diagonal mask from them), then
        the three M-RoPE rows; and the pixel tensors in sequence order."""
        rows = []
        for s, v in zip(seqs, visions, strict=True):
            p, _ = self.positions(s, v)
            text = torch.arange(len(s), device=self.device)[None]
            rows.append(torch.cat([text, p]))
        kwargs = self._pixels(visions, dtype)
        kwargs["position_ids"] = torch.cat(rows, dim=1)[:, None]
        return kwargs

    def _pixels(
        self, visions: Sequence[VisionInputs | None], dtype: torch.dtype | None
    ) -> dict[str, torch.Tensor]:
        out = VisionInputs.concat(visions, self.device)
        if dtype is not None and "pixel_values" in out:
            out["pixel_values"] = out["pixel_values"].to(dtype)
        return out


def vision_model(model: torch.nn.Module) -> VisionModel | None:
    """The `VisionModel` of `model`, or None for a text-only model. A vision-language architecture
    weir does not drive exactly raises ValueError."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None:
        return None
    if config.model_type not in MROPE_TYPES:
        raise ValueError(
            f"unsupported model: vision-language architecture {config.model_type!r}; weir runs "
            f"{', '.join(MROPE_TYPES)} with images (docs/multimodal.md)"
        )
    return VisionModel(model)
