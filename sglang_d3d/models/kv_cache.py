"""Slot KV cache: one row per request, writes at arbitrary cache indices.

Lengths (what is committed) live in the runners, not here: the cache is storage. Writing past a
row's committed length is how scratch work (verify blocks, pre-drafted branches) is done; rolling
back is just not advancing the length, and committing a pre-drafted token is a copy.
"""

from __future__ import annotations

import mmap

import torch

LAZY_BYTES = 1 << 20  # CPU caches from this size up take their pages from the OS as written


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        self.k = zeros(shape, dtype, device)
        self.v = zeros(shape, dtype, device)
        self.max_len = max_len

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def write(
        self,
        layer: int,
        slot_idx: torch.Tensor,  # [N, T] long
        pos: torch.Tensor,  # [N, T] long, cache indices
        k: torch.Tensor,  # [N, T, Hkv, D]
        v: torch.Tensor,  # [N, T, Hkv, D]
    ) -> None:
        self.k[layer].index_put_((slot_idx, pos), k)
        self.v[layer].index_put_((slot_idx, pos), v)

    def read(
        self, layer: int, slots: torch.Tensor | slice, span: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `span` cache indices: each [N, Hkv, span, D]."""
        k = self.k[layer][slots, :span]
        v = self.v[layer][slots, :span]
        return k.transpose(1, 2), v.transpose(1, 2)

    def copy_positions(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Move entries within one slot, all layers (e.g. commit a pre-drafted token)."""
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        self.k[:, slot, d] = self.k[:, slot, s]
        self.v[:, slot, d] = self.v[:, slot, s]

    def copy_range_from(self, other: KVCache, slot: int, start: int, end: int) -> None:
        """Entries [start, end) of `slot` become `other`'s (same layers and heads), all layers."""
        self.k[:, slot, start:end] = other.k[:, slot, start:end]
        self.v[:, slot, start:end] = other.v[:, slot, start:end]

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """dst's first `length` entries become src's, all layers."""
        self.k[:, dst, :length] = self.k[:, src, :length]
        self.v[:, dst, :length] = self.v[:, src, :length]


def slot_selector(slots: list[int]) -> torch.Tensor | slice:
    """A contiguous run of slots reads as a view (no copy) — the common batch-of-one case."""
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return torch.tensor(slots)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zero tensor. On a CPU, a large one is an anonymous mapping: the OS hands out zeroed
    pages as they are first written, so a cache sized for every slot at full context holds
    memory only for what requests have written (torch.zeros writes every page at once: the
    default server's two caches, 16 slots of 2k tokens, were about 3 GB resident at start)."""
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: a forked child (a grammar compile) copies what it writes instead of sharing it
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # the tensor keeps it alive
    return torch.frombuffer(pages, dtype=dtype).view(shape)
