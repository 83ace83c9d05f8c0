"""One search of the drafter's corpus index (speculative/corpus_lookup.py) with the caches as a
4-bit step leaves them: 64 MB swept through them before each search, so the table, numpy's
call machinery and the interpreter's own code all come back from memory, as in service.

    python benchmarks/bench_corpus_lookup.py --json benchmarks/results/corpus_lookup_xeon106.json

Prints the median microseconds of a search of the order-3 table through `np.searchsorted` and
through `bisect` on memoryviews (what `OrderTable.options` does), warm and after the sweep, and
of a first guess that misses (`CorpusIndex.continuation`).
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from sglang_d3d.models.corpus import first_tokens, read_corpus
from sglang_d3d.speculative.corpus_lookup import CorpusIndex

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_info, when run as a script
from run_info import run_info  # noqa: E402

DRAFTER = Path(__file__).resolve().parent.parent / "sglang_d3d" / "assets" / "drafter"


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    with np.load(DRAFTER / "corpus.npz") as z:
        fingerprint = str(z["target_fingerprint"])
    index = CorpusIndex(first_tokens(read_corpus(DRAFTER, fingerprint), 1 << 21))
    table = index.tables[3]
    keys, view = table.keys, memoryview(table.keys)
    rng = random.Random(0)
    missing = [int(keys[rng.randrange(len(keys))]) + 1 for _ in range(a.searches)]
    misses = [[rng.randrange(49152) for _ in range(8)] for _ in range(a.searches)]
    sweep = np.ones(64 << 20, dtype=np.uint8)
    searches = {
        "np.searchsorted": lambda k: int(np.searchsorted(keys, np.uint64(k))),
        "bisect": lambda k: bisect.bisect_left(view, k),
    }
    us = {}
    for name, search in searches.items():
        us[f"{name}, warm"] = _median_us([lambda k=k, f=search: f(k) for k in missing], None)
        us[f"{name}, after the sweep"] = _median_us([lambda k=k, f=search: f(k) for k in missing], sweep)
    us["continuation, a miss, after the sweep"] = _median_us(
        [lambda c=c: index.continuation(c, 8) for c in misses], sweep)
    for name, t in us.items():
        print(f"{name:40s} {t:7.1f} us")
    if a.json:
        Path(a.json).write_text(json.dumps({
            **run_info(weights="the default drafter's corpus"), "args": vars(a),
            "table_keys": len(keys), "median_us": us}, indent=1) + "\n")


def _median_us(calls: list, sweep: np.ndarray | None) -> float:
    """Median microseconds of each call, with `sweep` run through the caches before each."""
    times = []
    for call in calls:
        if sweep is not None:
            sweep[::64] += 1  # one byte a cache line
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--searches", type=int, default=200, help="searches timed per kind")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    if a.searches < 1:
        p.error("--searches must be at least 1")
    return a


if __name__ == "__main__":
    main()
