"""Where and in which precision the trainer computes: device, master-weight dtype, compute dtype.

Mixed precision as large-model training does it: the parameters, their gradients and AdamW's
moments stay in `param_dtype` (float32), while the forward and backward matmuls run in
`compute_dtype` (bfloat16 on a GPU). A bf16 update `w + lr * u` with lr 1e-6 is below bf16's
resolution (8 bits of mantissa: |w| * 2^-8) for most weights and is lost; on float32 masters
it is kept. Locally the compute dtype is applied with `torch.autocast`
(`train.mixed_precision: autocast`) or by running on a compute-dtype copy of the weights
(`compute_copy`: weir.train.compute_copy, what FSDP2 does); on Ray FSDP2's `MixedPrecisionPolicy`
casts the gathered shards (weir.train.sharded_actor.shard_model).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from weir.config.devices import choose_backends, resolve_device, resolve_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    """The trainer's device and dtypes, resolved from `train.*` (no `auto` left)."""

    device: torch.device
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    copy: bool = False
    """Compute on a compute-dtype copy of the weights (`train.mixed_precision: compute_copy`)
    rather than under autocast; only meaningful when `mixed`."""

    @classmethod
    def from_config(cls, train, *, device: str | torch.device | None = None) -> Precision:
        """Resolve `train.device`, `train.param_dtype`, `train.compute_dtype` and
        `train.mixed_precision`.

        `device` overrides `train.device` (a Ray rank is handed the GPU Ray gave it).
        """
        dev = (
            torch.device(device)
            if device is not None
            else resolve_device(train.device, key="train.device")
        )
        param = resolve_dtype(train.param_dtype, dev, gpu_default="float32")
        compute = resolve_dtype(train.compute_dtype, dev)
        if param == torch.bfloat16 and compute == torch.float32:
            raise ValueError(
                "train.compute_dtype=float32 with train.param_dtype=bfloat16 computes in more "
                "precision than the weights hold; use param_dtype=float32 or compute_dtype=bfloat16"
            )
        mode = getattr(train, "mixed_precision", "autocast")
        copy = mode == "compute_copy" or (mode == "auto" and dev.type == "cuda")
        return cls(dev, param, compute, copy)

    @property
    def mixed(self) -> bool:
        """Compute in a narrower dtype than the master weights."""
        return self.compute_dtype != self.param_dtype

    @property
    def autocasts(self) -> bool:
        """Whether the forward computes in `compute_dtype` by autocast (mixed, and not on a copy)."""
        return self.mixed and not self.copy

    def autocast(self) -> contextlib.AbstractContextManager:
        """Run the enclosed forward in `compute_dtype` under autocast (a no-op unless
        `autocasts`)."""
        if not self.autocasts:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)


def model_precision(train, model: torch.nn.Module) -> Precision:
    """What one process trains `model` in: its own device and parameter dtype, and `train`'s
    compute dtype (bfloat16 for bfloat16 parameters) by autocast or on a compute copy
    (`train.mixed_precision`; a no-op when it is not narrower than the parameters)."""
    p = next(model.parameters())
    asked = Precision.from_config(train, device=p.device)
    compute = torch.bfloat16 if p.dtype == torch.bfloat16 else asked.compute_dtype
    return Precision(p.device, p.dtype, compute, asked.copy)


def sharded_precision(model: torch.nn.Module, device: torch.device | None = None) -> Precision:
    """What an FSDP2 rank trains `model` in: its parameters' dtype throughout, because FSDP2's
    MixedPrecisionPolicy casts the gathered shards (autocast on top would cast again, and a
    compute copy swapped in before FSDP2's first forward would become what it gathers, so the
    float32 shards would stop training). `device`: the rank's, where its shards live elsewhere
    (CPU offload); else the parameters'."""
    p = next(model.parameters())
    return Precision(device if device is not None else p.device, p.dtype, p.dtype)


def setup_device(
    precision: Precision, *, deterministic: bool, cudnn_attention: bool = False
) -> None:
    """Select the CUDA device, enable TF32 matmuls where allowed, and allow cuDNN attention only
    when asked (`set_cudnn_attention`)."""
    if precision.device.type == "cuda":
        torch.cuda.set_device(precision.device)
    if choose_backends(
        precision.device, deterministic=deterministic, cudnn_attention=cudnn_attention
    ):
        log.info("TF32 matmuls enabled on %s", precision.device)


def compute_device(model: torch.nn.Module) -> torch.device:
    """The device `model`'s forward computes on: its parameters' device, except for an FSDP2
    module whose parameters rest in host memory (CPU offload) and are gathered to its accelerator
    for each forward; inputs and targets belong there."""
    get_state = getattr(model, "_get_fsdp_state", None)
    if callable(get_state):
        device = getattr(get_state(), "_device", None)
        if isinstance(device, torch.device):
            return device
    return next(model.parameters()).device
