"""weir's vLLM worker extension, imported INSIDE the vLLM server's workers (its own environment).

The server is started with ``--worker-extension-cls weir_vllm_ext.WeirWorkerExtension`` and this
directory on ``PYTHONPATH``; the methods become callable on every worker through vLLM's
``collective_rpc`` (the ``/collective_rpc`` endpoint of a server in dev mode). This module imports
nothing from weir: the vLLM environment does not have weir's dependencies.

- ``weir_load_safetensors(path)``: load every ``*.safetensors`` file of a directory through vLLM's
  in-place ``reload_weights`` (HF names, as weir's trainer writes them). Runs on CPU and GPU.
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

        tensors: dict = {}
        for f in files:
            tensors.update(load_file(str(f)))
        _tie_lm_head(self.model_runner.model_config.hf_config, tensors)
        # vLLM's in-place reload, not model.load_weights: after loading, vLLM repacks some weights
        # into kernel formats (on CPU the linear layers' original parameters are emptied), and
        # reload_weights re-runs that processing layer by layer.
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)

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
        received = {}
        for name, dtype, shape in metas:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
            group.broadcast(t, src=0, stream=torch.cuda.current_stream())
            received[name] = t
        torch.cuda.synchronize()
        _tie_lm_head(self.model_runner.model_config.hf_config, received)
        self.reload_weights(weights_iterator=iter(received.items()), is_checkpoint_format=True)
        return len(metas)


def _tie_lm_head(hf_config, tensors: dict) -> None:
    """Give a tied model's lm_head its weights explicitly.

    A trainer's ``named_parameters()`` lists a tied embedding once (``model.embed_tokens.weight``).
    vLLM 0.32's in-place reload does not keep the tie once ``lm_head.weight`` has been loaded on
    its own (measured: after one update that carried it, later updates without it left lm_head on
    the old weights), so weir always sends both.
    """
    if (
        getattr(hf_config, "tie_word_embeddings", False)
        and "lm_head.weight" not in tensors
        and "model.embed_tokens.weight" in tensors
    ):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
