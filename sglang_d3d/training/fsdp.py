"""`--fsdp`: the frozen target's projections sharded across ranks (FSDP2, fully_shard).

A drafter at full depth is the target itself plus small deltas, so the target's weights are
what fills a GPU. Each decoder layer's q/k/v/o and MLP projections (nearly all of a target's
weights) are sharded one module at a time: each rank keeps 1/N of every projection and gathers
a whole one just before it runs (forward, and again in the backward pass of the mask blocks).
The drafter calls those very Linear modules (models/adapters.py wraps them), so its passes
and the target's both gather through the same hooks. Embeddings, norms and the LM head stay
whole on every rank; the trainable tensors are replicated and their gradients summed
(training/distributed.py). Every rank must run the same passes in the same order, so with
--fsdp every rank also runs the held-out evaluation (only rank 0 logs it).
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_d3d.models.adapters import ATTN_PROJ, MLP_PROJ
from sglang_d3d.training.distributed import Dist


class FSDPUnavailable(RuntimeError):
    pass


def projections(target) -> list[nn.Module]:
    """The target's own q/k/v/o and MLP Linear modules, layer by layer."""
    out = []
    for layer in target.layers:
        out += [getattr(layer.self_attn, n) for n in ATTN_PROJ]
        out += [getattr(layer.mlp, n) for n in MLP_PROJ]
    return out


def shard_target(target, d: Dist) -> int:
    """Shard every projection over the ranks, on d.device -> the number of sharded modules.
    The target may be loaded on the CPU: each shard lands on the mesh's device."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:  # torch < 2.6
        raise FSDPUnavailable(f"--fsdp needs torch.distributed.fsdp.fully_shard: {e}") from None
    if not d.enabled:
        raise FSDPUnavailable("--fsdp needs several processes (torchrun --nproc_per_node N)")
    mesh = init_device_mesh(torch.device(d.device).type, (d.world,))
    mods = projections(target)
    for m in mods:
        fully_shard(m, mesh=mesh)
    return len(mods)


def place_unsharded(modules: list[nn.Module], device: str) -> None:
    """Move every parameter and buffer that FSDP does not manage to `device`, in place (the
    same Parameter objects: tied and shared weights stay shared)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen and not isinstance(p, DTensor):
                p.data = p.data.to(device)
            seen.add(id(p))
        for sub in module.modules():
            for name, buf in list(sub._buffers.items()):
                if buf is not None:
                    sub._buffers[name] = buf.to(device)
