"""The engine's memory report: KV caches by the formula the docs give, weights counted once; CPU
caches resident only where written."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch
from engine_helpers import make_engine

from sglang_d3d.config import Mode, SamplingParams
from sglang_d3d.engine.memory import memory_report, storages
from sglang_d3d.engine.offline import generate
from sglang_d3d.models import kv_cache
from sglang_d3d.models.kv_cache import KVCache


def test_views_and_arrays_count_their_storage_once():
    w = torch.zeros(10, 4)  # 160 bytes
    a = np.zeros(8, dtype=np.float32)  # 32 bytes
    u = torch.zeros(6, dtype=torch.float64)  # 48 bytes, also seen through numpy
    holder = {"w": w, "view": w[2:5], "again": [w.t()], "arr": a, "arr_view": a[1:3],
              "u": u, "u_np": u.numpy()[1:4], "u_np_whole": u.numpy()}
    assert sorted(storages(holder).values()) == [32, 48, 160]


def test_report_counts_caches_and_separates_shared_weights(tiny_models):
    eng = make_engine(tiny_models, Mode.SYNC, batch=3, context=64)
    r = memory_report(eng)
    target, cache = tiny_models[1], eng.target.cache
    a, positions = target.arch, cache.max_len  # the context plus a verify block of scratch
    # the formula docs/api.md gives: 2 x layers x slots x positions x kv_heads x head_dim x bytes
    formula = 2 * target.num_layers * 3 * positions * a.num_kv_heads * a.head_dim * 8  # float64
    assert r.target_kv_cache == formula and positions >= 64
    d = eng.drafting.runner.cache
    assert r.drafter_kv_cache == d.k.numel() * d.k.element_size() * 2
    params = sum(p.numel() * p.element_size() for p in tiny_models[1].parameters())
    assert r.target_weights >= params  # its own, plus any copies its fast paths made
    # the drafter shares the target's layers: only its deltas and copies are its own
    assert 0 < r.drafter_weights < r.target_weights
    assert r.total == sum(r.parts().values())
    assert "target kv cache" in r.summary()


def test_plain_decoding_has_no_drafter_memory(tiny_models):
    r = memory_report(make_engine(tiny_models, Mode.AR, batch=2, context=32))
    assert r.drafter_weights == 0 and r.drafter_kv_cache == 0 and r.target_kv_cache > 0


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_a_large_cpu_cache_holds_memory_only_where_written():
    """256 MiB of keys and values, zero everywhere, resident only as requests write them."""
    before = _resident_mib()
    cache = KVCache(8, 16, 4096, 2, 64, torch.float32, "cpu")  # 2 x 128 MiB
    assert _resident_mib() - before < 32
    assert not cache.k[:, 3].any() and not cache.v[-1].any()
    k = torch.randn(1, 100, 2, 64)
    cache.write(0, torch.zeros(1, 100, dtype=torch.long), torch.arange(100).unsqueeze(0), k, k * 2)
    keys, values = cache.read(0, slice(0, 1), 100)
    assert torch.equal(keys, k.transpose(1, 2)) and torch.equal(values, 2 * k.transpose(1, 2))
    assert _resident_mib() - before < 64


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.ASYNC])
def test_modes_stay_exact_on_lazily_resident_caches(tiny_models, monkeypatch, mode):
    """Every cache of the engine on the mapped pages (the tiny models' are below the size that
    takes them otherwise): greedy output still equals plain decoding's."""
    monkeypatch.setattr(kv_cache, "LAZY_BYTES", 0)
    mapped, real = [], mmap.mmap
    monkeypatch.setattr(kv_cache.mmap, "mmap", lambda *a, **kw: mapped.append(a[1]) or real(*a, **kw))
    params, prompts = SamplingParams(max_new_tokens=16), [[5, 6, 7, 8], [9, 10, 11, 9, 10]]
    eng = make_engine(tiny_models, mode, batch=2, context=64)
    assert len(mapped) >= 4  # keys and values of the target's and the drafter's caches
    outs = [o.token_ids for o in generate(eng, prompts, params)]
    monkeypatch.setattr(kv_cache, "LAZY_BYTES", 1 << 62)
    assert outs == [o.token_ids for o in generate(make_engine(tiny_models, Mode.AR, batch=2, context=64),
                                                    prompts, params)]
