"""Tiny training data for the trainer's tests: random sequences in datagen's shard format
(training needs no real answers; held-out acceptance is then near its floor)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sglang_d3d.training.shards import Sample, shard_name, write_manifest, write_shard


def write_random_data(folder: Path, shards: int = 2, per_shard: int = 20,
                      vocab: int = 96) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for k in range(shards):
        samples = [Sample(rng.integers(3, vocab, rng.integers(4, 9)),
                          rng.integers(3, vocab, rng.integers(8, 20)), i % 2, k * per_shard + i)
                   for i in range(per_shard)]
        write_shard(folder / shard_name(k), samples, [True] * per_shard)
        names.append(shard_name(k))
    write_manifest(folder, {"shards": names, "generator": "random test data",
                            "generation": {"max_new_tokens": 20, "temperature": 0.0}})
