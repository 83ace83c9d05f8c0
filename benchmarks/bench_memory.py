"""Resident memory of the default engine (the server's defaults, no calibration): once built, and
once every page of its KV caches has been written, as when all slots fill their context.

    python benchmarks/bench_memory.py

The caches on a CPU take their pages from the OS as requests write them (models/kv_cache.py),
so a server holds the first figure plus what its requests have written, up to the second.
"""

from __future__ import annotations

from pathlib import Path

from sglang_d3d.config import EngineConfig
from sglang_d3d.engine.factory import build_engine


def resident_kib() -> int:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0])


def main() -> None:
    engine, _ = build_engine(EngineConfig(), calibrate_now=False)
    built = resident_kib()
    caches = [engine.target.cache] + ([engine.drafting.runner.cache] if engine.drafting else [])
    for cache in caches:
        cache.k.fill_(0.0)
        cache.v.fill_(0.0)
    print(f"VmRSS: engine built {built / 2**20:.2f} GiB; every KV cache page written "
          f"{resident_kib() / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
