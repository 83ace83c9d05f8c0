"""The drafter's cache inside SGLang's memory budget.

SGLang 0.5.23 builds the speculative worker before it sizes its KV pool, and then gives the
pool what is free minus its runtime slack (mem_cache/kv_cache_configurator.py
`_profile_available_bytes`):

    pool = free memory - pre_model_load_memory * (1 - mem_fraction_static)

The drafter's cache (dense: one row per running request, each as long as the target's context)
is allocated first, so it comes out of that pool. A long-context target with a deep drafter
easily asks more than the GPU has (Qwen3-8B's 40,960 tokens x 36 layers x 32 slots: about
190 GB in bf16), and SGLang then fails at start with an out-of-memory error that names neither
the drafter nor the flags that size it. The worker checks first and refuses with both.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_d3d.config import SpecConfig
from sglang_d3d.speculative.drafting import draft_cache_len, max_branches

# The most of SGLang's KV pool the drafter's cache may take: the target keeps at least as many
# bytes of KV cache as the drafter.
MAX_POOL_SHARE = 0.5
# On a GPU of its own (SGLANG_D3D_DRAFT_DEVICE), what the cache may take of the free memory;
# the rest is the drafter's activations.
MAX_FREE_SHARE = 0.9


@dataclass(frozen=True)
class CacheShape:
    """What the drafter's cache holds: K and V for every layer, slot and position."""

    layers: int
    slots: int
    positions: int  # per slot: the target's context plus one cycle's scratch
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def num_bytes(self) -> int:
        return 2 * self.layers * self.slots * self.positions * self.kv_heads * self.head_dim * (
            self.dtype_bytes)


def cache_shape(drafter, slots: int, context: int, spec: SpecConfig) -> CacheShape:
    """The cache `Drafting.create(drafter, slots, context, spec)` would allocate."""
    arch = drafter.arch
    positions = draft_cache_len(context, spec.block_size, drafter.cfg.smallest_block,
                                max_branches(spec))
    return CacheShape(drafter.num_layers, slots, positions, arch.num_kv_heads, arch.head_dim,
                      drafter.mask_embedding.element_size())


def pool_budget(free_bytes: int, pre_model_load_bytes: float, mem_fraction_static: float) -> float:
    """The bytes SGLang would give its KV pool now (the formula above)."""
    return free_bytes - pre_model_load_bytes * (1 - mem_fraction_static)


def check_cache(shape: CacheShape, budget: float, share: float) -> None:
    """Raise MemoryError, with the numbers and the flags to change, when the cache would take
    more than `share` of `budget` bytes."""
    if shape.num_bytes <= share * budget:
        return
    gb = 1 << 30
    raise MemoryError(
        f"the D3D drafter's cache needs {shape.num_bytes / gb:.1f} GB ({shape.slots} slots x "
        f"{shape.positions} positions x {shape.layers} layers), more than {share:.0%} of the "
        f"{max(budget, 0) / gb:.1f} GB available for KV caches on its device; lower "
        "--max-running-requests (one slot each) or --context-length, or put the drafter on "
        "a GPU of its own (SGLANG_D3D_DRAFT_DEVICE)"
    )
