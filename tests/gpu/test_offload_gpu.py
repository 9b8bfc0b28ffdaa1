"""A colocated trainer's offload to pinned host memory (`weir.train.offload`, cluster.offload_pinned)
on a GPU: what lands in host memory is pinned, complete when the move returns, and the same values
come back."""

from __future__ import annotations

import pytest
import torch

from weir.train.offload import host_bytes, move_trainer

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


class RepadsOnMove(torch.nn.Module):
    """Reads its parameter on the host right after a move, as FSDP2's `reset_sharded_param` does
    when it re-pads an unevenly sharded parameter (a host-side copy of the moved tensor)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(numel, device=CUDA).uniform_())
        self.seen: torch.Tensor | None = None

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.weight.device.type == "cpu":
            self.seen = torch.zeros_like(self.weight).copy_(self.weight.detach())
        return out


def test_a_pinned_offload_is_complete_when_it_returns_and_comes_back_exactly():
    # 256 MiB, so that a host read racing the transfer would see it unfinished
    model = RepadsOnMove(64 * 2**20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.weight.sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    want = model.weight.detach().cpu()
    want_m = optimizer.state[model.weight]["exp_avg"].cpu()

    moved = move_trainer([model], optimizer, CPU, pinned=True)
    assert moved == 3 * want.numel() * 4  # the weights and AdamW's two moments
    assert torch.equal(model.seen, want)  # the host read after the move saw every value
    assert torch.equal(model.weight.detach(), want)
    assert torch.equal(optimizer.state[model.weight]["exp_avg"], want_m)
    assert host_bytes([model], optimizer) == {"host": moved, "pinned": moved}
    assert torch.cuda.memory_allocated(CUDA) < 2**20  # nothing left on the device

    move_trainer([model], optimizer, CUDA, pinned=True)
    assert model.weight.is_cuda and torch.equal(model.weight.detach().cpu(), want)
    assert torch.equal(optimizer.state[model.weight]["exp_avg"].cpu(), want_m)
    model.weight.sum().backward()
    optimizer.step()  # the optimizer still holds the same Parameter and its state
    assert not torch.equal(model.weight.detach().cpu(), want)


def test_without_pinning_the_host_copies_are_ordinary_memory():
    model = RepadsOnMove(2**20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.weight.sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    moved = move_trainer([model], optimizer, CPU, pinned=False)
    assert host_bytes([model], optimizer) == {"host": moved, "pinned": 0}
