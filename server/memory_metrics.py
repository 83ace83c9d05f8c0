"""`d3d:memory_bytes{part}`: what the engine's weights and KV caches hold, read at each scrape.

The parts are engine/memory.py's MemoryReport fields (target_weights, target_kv_cache,
drafter_weights, drafter_kv_cache). Their sum is most of the server's resident memory;
`--max-batch-size` and `--max-context` size the two caches (docs/api.md, "Memory").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client.core import GaugeMetricFamily


class MemoryCollector:
    def __init__(self, source: Callable[[], Any], labels: dict[str, str]) -> None:
        self._source, self._labels = source, labels  # source() -> MemoryReport or None

    def describe(self) -> list:
        return []  # known only once the engine has loaded

    def collect(self):
        report = self._source()
        if report is None:  # loading, or a backend that does not report (SGLang sizes its pool)
            return
        g = GaugeMetricFamily(
            "d3d:memory_bytes", "Bytes held by the engine's weights and KV caches, by part.",
            labels=[*self._labels, "part"])
        for part, nbytes in report.parts().items():
            g.add_metric([*self._labels.values(), part], float(nbytes))
        yield g
