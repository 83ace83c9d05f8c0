"""The engine's memory report: KV caches by the formula the docs give, weights counted once."""

from __future__ import annotations

import numpy as np
import torch
from engine_helpers import make_engine

from sglang_d3d.config import Mode
from sglang_d3d.engine.memory import memory_report, storages


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
