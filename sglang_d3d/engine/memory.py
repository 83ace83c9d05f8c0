"""What the embedded engine holds in memory, by part: the models' weights and their KV caches.

A server's memory is set mostly by two flags. Each KV cache holds, for every slot
(`--max-batch-size`) and every position up to `--max-context` (plus a verify block of scratch):

    bytes = 2 (keys, values) x layers x slots x positions x kv_heads x head_dim x dtype bytes

The drafter keeps a cache of its own over its kept layers (a full-depth drafter: as many as the
target). The weights are counted as the tensors (and numpy arrays) the runners hold: the
target's own, plus whatever copies its fast paths made (packed fp32 matrices, int8 or 4-bit
copies); the drafter's are counted beyond what it shares with the target.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

MiB = 1 << 20


@dataclass(frozen=True)
class MemoryReport:
    target_weights: int  # bytes
    target_kv_cache: int
    drafter_weights: int  # beyond the tensors it shares with the target
    drafter_kv_cache: int

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def parts(self) -> dict[str, int]:
        return asdict(self)

    def summary(self) -> str:
        parts = ", ".join(f"{k.replace('_', ' ')} {v / MiB:.0f} MiB" for k, v in self.parts().items())
        return f"memory: {parts}; total {self.total / MiB:.0f} MiB"


def kv_cache_bytes(cache: Any) -> int:
    """The bytes of a KVCache's keys and values (0 for None)."""
    if cache is None:
        return 0
    return cache.k.nelement() * cache.k.element_size() + cache.v.nelement() * cache.v.element_size()


def storages(root: Any, skip: tuple[Any, ...] = ()) -> dict[int, int]:
    """Every tensor or array reachable from `root` through attributes, modules, lists and dicts:
    {storage address: bytes}, each storage once however many views point into it. Objects in
    `skip` (the KV caches, counted on their own) are not entered."""
    found: dict[int, int] = {}
    skipped = {id(s) for s in skip}
    for t in _walk(root, skipped):
        while isinstance(t, np.ndarray) and t.base is not None:  # a view: count what it views
            t = t.base
        if isinstance(t, torch.Tensor):
            key, nbytes = _tensor_storage(t)
        elif isinstance(t, np.ndarray):
            key, nbytes = t.__array_interface__["data"][0], t.nbytes
        else:  # an array over a foreign buffer (bytes, mmap): its own bytes, once
            key, nbytes = id(t), getattr(t, "nbytes", 0) or len(memoryview(t))
        found[key] = nbytes
    return found


def _tensor_storage(t: torch.Tensor) -> tuple[int, int]:
    if t.device.type == "meta":
        return id(t), 0
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (NotImplementedError, RuntimeError):  # opaque (e.g. oneDNN-packed) weights
        return id(t), t.numel() * t.element_size()


def _walk(root: Any, skipped: set[int]) -> Iterator[torch.Tensor | np.ndarray]:
    seen: set[int] = set(skipped)
    stack = [root]
    while stack:  # iterative: a model's object graph is deep
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            yield obj
        elif isinstance(obj, torch.ScriptObject) and hasattr(obj, "unpack"):
            stack.append(obj.unpack())  # fbgemm's packed int8 weights: (weight, bias)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())


def memory_report(engine: Any) -> MemoryReport:
    """Bytes by part for a SpecEngine (engine/engine.py)."""
    target_cache = engine.target.cache
    runner = getattr(engine.drafting, "runner", None)
    draft_cache = getattr(runner, "cache", None)
    if draft_cache is target_cache:  # fused mode writes the target's own cache
        draft_cache = None
    caches = tuple(c for c in (target_cache, draft_cache) if c is not None)
    target = storages(engine.target, skip=caches)
    drafter = storages(engine.drafting, skip=caches + (engine.target,))
    return MemoryReport(
        target_weights=sum(target.values()),
        target_kv_cache=kv_cache_bytes(target_cache),
        drafter_weights=sum(b for k, b in drafter.items() if k not in target),
        drafter_kv_cache=kv_cache_bytes(draft_cache),
    )
