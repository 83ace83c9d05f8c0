"""Data-parallel training across processes started by torchrun (or one process without it).

Every rank holds the whole drafter (its trainable tensors are small: deltas and the mask
embedding) and builds the same global batch plan from the same seed, then runs only its own
rows. Each rank's loss is its rows' summed loss over the global number of loss rows, so summing
the trainable tensors' gradients across ranks (one flat all-reduce per step, what DDP's
buckets do) gives exactly the gradient of one process over the whole batch: N processes and
one process take the same steps, up to float rounding.

gloo on CPUs, nccl on CUDA; the rank, world size and rendezvous come from torchrun's
environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    device: str = "cpu"  # this rank's device ("cuda:<local rank>" under torchrun on GPUs)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def rows(self, n: int) -> slice:
        """This rank's rows of a global batch of n >= world rows (the first n % world ranks
        take one row fewer when n does not divide)."""
        return slice(self.rank * n // self.world, (self.rank + 1) * n // self.world)


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device: str) -> Dist:
    """Join the process group torchrun describes; a single process without it needs none."""
    if not launched_by_torchrun():
        return Dist(device=device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return Dist(rank, world, device)


def finish(d: Dist) -> None:
    """Wait for every rank before leaving: rank 0 alone writes checkpoints and exports, and a
    gloo rank that tears its group down while a peer is still busy can abort the process."""
    if d.enabled and dist.is_initialized():
        dist.barrier()


def shutdown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()


def all_sum(d: Dist, values: torch.Tensor) -> torch.Tensor:
    """values summed over ranks: a new tensor on the input's device, the input left alone.
    The reduction runs on this rank's device (nccl reduces CUDA tensors only)."""
    if not d.enabled:
        return values.detach().clone()
    out = values.detach().to(d.device, copy=True)
    dist.all_reduce(out)
    return out.to(values.device)


def agree(d: Dist, flags: list[bool]) -> list[bool]:
    """Each flag true on any rank -> true on all: a stop asked on one rank (its clock, its
    signal) stops every rank after the same step, so none waits on a collective forever."""
    if not d.enabled:
        return flags
    t = torch.tensor([float(f) for f in flags], device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def agree_min(d: Dist, value: int) -> int:
    """The smallest of each rank's value (ranks that read a growing data folder at slightly
    different moments train on the samples they all saw)."""
    if not d.enabled:
        return value
    t = torch.tensor([value], dtype=torch.long, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def sum_gradients(d: Dist, params: list[torch.nn.Parameter]) -> None:
    """Sum each parameter's gradient over ranks in place, in one flat buffer."""
    if not d.enabled:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).to(g.dtype)
        offset += n
