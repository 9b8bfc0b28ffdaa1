"""weir's vLLM worker extension, imported INSIDE the vLLM server's workers (its own environment).

The server is started with ``--worker-extension-cls weir_vllm_ext.WeirWorkerExtension`` and this
directory on ``PYTHONPATH``; the methods become callable on every worker through vLLM's
``collective_rpc`` (the ``/collective_rpc`` endpoint of a server in dev mode). This module imports
nothing from weir: the vLLM environment does not have weir's dependencies.

- ``weir_load_safetensors(path)``: load every ``*.safetensors`` file of a directory through the
  model's own ``load_weights`` (HF names, as weir's trainer writes them). Runs on CPU and GPU.
- ``weir_init_broadcast`` / ``weir_receive_broadcast``: NCCL weights straight from trainer rank 0,
  following vLLM's documented RLHF example (StatelessProcessGroup + PyNcclCommunicator). GPU only;
  NOT run in weir's tests (no GPU there).
- ``weir_weights_hash()``: sha256 of the model's parameters, to check that an update went in.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


class WeirWorkerExtension:
    """Mixed into vLLM's worker class; ``self.model_runner.model`` is the served model."""

    def weir_load_safetensors(self, path: str) -> int:
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {path}")

        def weights():
            for f in files:
                yield from load_file(str(f)).items()

        loaded = self.model_runner.model.load_weights(weights=weights())
        return len(loaded) if loaded is not None else -1

    def weir_weights_hash(self) -> str:
        h = hashlib.sha256()
        for name, p in sorted(self.model_runner.model.named_parameters()):
            t = p.detach().float().cpu().contiguous()
            h.update(f"{name}|{tuple(t.shape)}|".encode())
            h.update(t.numpy().tobytes())
        return h.hexdigest()

    def weir_init_broadcast(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join the weight-broadcast group (rank 0: the trainer). GPU only, not run in weir's CI."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.parallel_state import get_world_group
        from vllm.distributed.utils import StatelessProcessGroup

        rank = get_world_group().rank + rank_offset
        pg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
        self._weir_group = PyNcclCommunicator(pg, device=self.device)

    def weir_receive_broadcast(self, metas: list[tuple[str, str, list[int]]]) -> int:
        """Receive tensors (name, dtype, shape) in order from rank 0 and load them. GPU only."""
        import torch

        group = getattr(self, "_weir_group", None)
        if group is None:
            raise RuntimeError("weir_init_broadcast first")
        for name, dtype, shape in metas:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
            group.broadcast(t, src=0, stream=torch.cuda.current_stream())
            self.model_runner.model.load_weights(weights=[(name, t)])
        torch.cuda.synchronize()
        return len(metas)
