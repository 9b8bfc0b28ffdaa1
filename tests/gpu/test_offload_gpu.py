"""A colocated trainer's offload to pinned host memory (`weir.train.offload`, cluster.offload_pinned)
on a GPU: what lands in host memory is pinned, complete when the move returns, and the same values
come back, for a plain module and for an FSDP2-sharded one."""

from __future__ import annotations

import pytest
import torch

from weir.train.offload import host_bytes, move_trainer

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
TAIL = 4096


class RepadsOnMove(torch.nn.Module):
    """Reads its parameter on the host inside the move, as FSDP2's `reset_sharded_param` does when
    it re-pads an unevenly sharded parameter (a host-side copy of the moved tensor)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(numel, device=CUDA).uniform_(1.0, 2.0))
        self.seen: torch.Tensor | None = None

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.weight.device.type == "cpu":  # the last values a transfer writes
            self.seen = self.weight.detach()[-TAIL:].clone()
        return out


def _stepped(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.sum() for p in model.parameters()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def test_a_pinned_offload_is_complete_when_it_returns_and_comes_back_exactly():
    model = RepadsOnMove(64 * 2**20)  # 256 MiB
    optimizer = _stepped(model)
    want = model.weight.detach().cpu()
    want_m = optimizer.state[model.weight]["exp_avg"].cpu()

    # hold the device's stream back, so that a transfer still runs when the host reads: without
    # the wait for each host copy, `seen` would read memory not yet written
    torch.cuda._sleep(int(1e9))
    moved = move_trainer([model], optimizer, CPU, pinned=True)
    assert moved == 3 * want.numel() * 4  # the weights and AdamW's two moments
    assert torch.equal(model.seen, want[-TAIL:])
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
    optimizer = _stepped(model)
    moved = move_trainer([model], optimizer, CPU, pinned=False)
    assert host_bytes([model], optimizer) == {"host": moved, "pinned": 0}


def test_an_fsdp2_module_round_trips_through_pinned_memory(tiny_model_dir):
    """The sharded parameters (DTensors) of a one-rank group: pinned on the host, the same values
    back on the device, and the model still computes and trains."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from weir.train.distributed import free_port
    from weir.train.sharded_actor import shard_model

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        model = shard_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA))
        ids = torch.tensor([[5, 6, 7, 8]], device=CUDA)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(ids).logits.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        want = {k: v.to_local().cpu().clone() for k, v in model.state_dict().items()}
        params = list(model.parameters())

        moved = move_trainer([model], optimizer, CPU, pinned=True)
        assert host_bytes([model], optimizer) == {"host": moved, "pinned": moved}
        assert all(p.to_local().device.type == "cpu" for p in model.parameters())

        move_trainer([model], optimizer, CUDA, pinned=True)
        # the optimizer's Parameter objects, moved in place, with their values
        assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
        got = {k: v.to_local().cpu() for k, v in model.state_dict().items()}
        assert all(torch.equal(got[k], want[k]) for k in want)
        model(ids).logits.sum().backward()
        optimizer.step()
        name, first = next(iter(model.named_parameters()))
        assert not torch.equal(first.to_local().cpu(), want[name])
    finally:
        dist.destroy_process_group()


def test_overlapped_state_moves_are_waited_for_by_the_step_and_land_pinned():
    """`StateMover`: AdamW's state comes to the device on a stream of its own (held back here, so
    that a step not waiting for it would read memory not yet written) and goes back to pinned host
    memory after the step (the compute stream held back, so that a copy not waiting for the step
    would take the old values). Three steps land exactly where moves that wait land."""
    from weir.train.offload import StateMover, move_optimizer_state

    def run(overlap: bool):
        torch.manual_seed(0)
        model = torch.nn.Linear(2048, 2048, device=CUDA)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mover = StateMover(CUDA, pinned=True)
        x = torch.randn(64, 2048, device=CUDA)
        for _ in range(3):
            if overlap:
                with torch.cuda.stream(mover.stream):
                    torch.cuda._sleep(int(5e8))
                mover.to_device(optimizer, CUDA)
            else:
                move_optimizer_state(optimizer, CUDA)
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if overlap:
                torch.cuda._sleep(int(5e8))
                mover.to_host(optimizer)
                mover.wait()
            else:
                move_optimizer_state(optimizer, CPU, non_blocking=True)
                torch.cuda.synchronize()
        state = optimizer.state[model.weight]
        assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].is_pinned()
        return model.weight.detach().cpu(), state["exp_avg"].clone()

    (w1, m1), (w2, m2) = run(True), run(False)
    assert torch.equal(w1, w2) and torch.equal(m1, m2)
