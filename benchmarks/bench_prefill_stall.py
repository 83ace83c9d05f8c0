"""How long a long prompt stalls the requests already decoding, by prefill chunk size.

Starts STREAMS short requests, lets them decode, then submits one LONG-token prompt. Reports
the streams' inter-token latency (time between their token events) before the long prompt
arrived and while it was prefilled, the long prompt's time to first token and prefill rate.
Runs once per --chunks value (prompt tokens prefilled per step while others decode; a value
as large as the prompt is the old behaviour: the whole prompt in one pass).

    .venv/bin/python benchmarks/bench_prefill_stall.py --threads 1 --chunks 64 256 4096 \
        --json benchmarks/results/prefill_stall.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sglang_d3d.api import GenerationRequest
from sglang_d3d.config import EngineConfig, Mode, SamplingParams
from sglang_d3d.engine.engine import SpecEngine
from sglang_d3d.engine.factory import load_models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="ar", choices=[m.value for m in Mode])
    p.add_argument("--long", type=int, default=3000)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 4096])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_grad_enabled(False)
    base = EngineConfig(mode=Mode(a.mode), max_context=a.long + 1100)
    target, drafter, _ = load_models(base)
    rows = {c: _run(a, target, drafter, c) for c in a.chunks}
    print("| prefill chunk | stream ITL before, ms | ITL during the long prefill: median / max, ms | long TTFT, s | prefill tok/s |")
    print("|---|---|---|---|---|")
    for c, r in rows.items():
        print(f"| {c} | {r['itl_before_ms']} | {r['itl_during_median_ms']} / {r['itl_during_max_ms']} | "
              f"{r['long_ttft_s']} | {r['prefill_tok_s']} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1) + "\n")


def _run(a, target, drafter, chunk: int) -> dict:
    t, d = (a.threads - a.threads // 2, a.threads // 2) if a.mode == "async" else (a.threads, a.threads)
    cfg = EngineConfig(mode=Mode(a.mode), max_context=a.long + 1100, prefill_chunk=min(chunk, 4096),
                       max_prefill_tokens=max(chunk, 1024), target_threads=t, draft_threads=d)
    eng = SpecEngine(cfg, target, drafter if a.mode != "ar" else None)
    torch.set_num_threads(d)
    times: dict[str, list[float]] = {}

    def submit(rid: str, ids: list[int], n: int) -> None:
        times[rid] = []
        eng.submit(GenerationRequest(rid, ids, SamplingParams(max_new_tokens=n)))

    def step() -> None:
        for ev in eng.step():
            if ev.token_ids:
                times[ev.request_id].append(time.perf_counter())

    for i in range(a.streams):
        submit(f"s{i}", [1, 2, 3 + i, 50 + i, 60], 1000)  # decoding all along
    for _ in range(4):  # prefills, first cycles
        step()
    t_warm = time.perf_counter()
    for _ in range(8):
        step()
    t_submit = time.perf_counter()
    submit("long", [100 + (7 * i) % 40000 for i in range(a.long)], 1)
    while not times["long"]:
        step()
    t_first = times["long"][0]
    for _ in range(3):  # the streams' next tokens close the gaps still open
        step()
    before, during = [], []
    for i in range(a.streams):
        ts = times[f"s{i}"]
        for x, b in zip(ts, ts[1:]):
            if t_warm <= x and b < t_submit:
                before.append(b - x)
            elif b >= t_submit and x <= t_first:  # the gap overlaps the long prefill
                during.append(b - x)
    eng.shutdown()
    ms = lambda xs, f: round(1e3 * f(xs), 1)  # noqa: E731
    return {"itl_before_ms": ms(before, statistics.median), "itl_during_median_ms": ms(during, statistics.median),
            "itl_during_max_ms": ms(during, max), "long_ttft_s": round(t_first - t_submit, 2),
            "prefill_tok_s": round(a.long / (t_first - t_submit), 1)}


if __name__ == "__main__":
    main()
