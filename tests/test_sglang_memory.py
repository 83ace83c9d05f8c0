"""The drafter's cache against SGLang's memory budget (sglang_worker/memory.py). No sglang needed."""

from __future__ import annotations

import pytest

from sglang_d3d.config import SpecConfig
from sglang_d3d.sglang_worker.memory import CacheShape, cache_shape, check_cache, pool_budget
from sglang_d3d.speculative.drafting import Drafting

GB = 1 << 30


def test_the_shape_is_the_cache_drafting_allocates(tiny_models):
    drafter = tiny_models[2]
    spec = SpecConfig(block_size=4)
    shape = cache_shape(drafter, slots=3, context=100, spec=spec)
    cache = Drafting.create(drafter, 3, 100, spec).runner.cache
    assert shape.num_bytes == 2 * cache.k.numel() * cache.k.element_size()  # K and V


def test_a_long_context_target_is_refused_with_the_flags_that_size_the_cache():
    """A Qwen3-8B-shaped full-depth drafter at 40,960 tokens and 32 slots: about 180 GB."""
    shape = CacheShape(layers=36, slots=32, positions=41_000, kv_heads=8, head_dim=128,
                       dtype_bytes=2)
    budget = pool_budget(free_bytes=120 * GB, pre_model_load_bytes=140 * GB,
                         mem_fraction_static=0.88)
    assert budget == pytest.approx(120 * GB - 0.12 * 140 * GB)
    with pytest.raises(MemoryError, match="--max-running-requests.*--context-length"):
        check_cache(shape, budget, 0.5)
    check_cache(CacheShape(36, 2, 8_192, 8, 128, 2), budget, 0.5)  # 2 slots of 8k fit
