"""`d3d bench-serving` against a running tiny server: plain, logprobs and n requests, and the
cost of the last two against plain (issue 13). A few requests; no timing is asserted."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from server.app import create_app
from server.testing import ServerThread, tiny_server_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_serving", ROOT / "benchmarks" / "bench_serving.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_variants_are_sent_and_costed(tiny_pair_dir, tmp_path, monkeypatch):
    data = tmp_path / "datasets"
    (data / "gsm8k").mkdir(parents=True)
    rows = [{"question": f"w{5 + i} w{6 + i} w{7 + i}"} for i in range(4)]
    (data / "gsm8k" / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setenv("D3D_DATASETS", str(data))
    bench = load_bench()
    cfg = dataclasses.replace(tiny_server_config(tiny_pair_dir), api_keys=("bench-key",))
    out = tmp_path / "bench.json"
    with ServerThread(create_app(cfg)) as srv:
        argv = ["--url", srv.url, "--datasets", "gsm8k", "--concurrency", "2",
                "--num-prompts", "4", "--max-tokens", "6", "--n", "3", "--top-logprobs", "4",
                "--api-key", "bench-key", "--out", str(out)]  # fmt: skip
        assert bench.main(argv) == 0
    saved = json.loads(out.read_text())
    by_variant = {r["variant"]: r for r in saved["results"]}
    assert set(by_variant) == {"plain", "logprobs", "n"}
    for r in by_variant.values():
        assert r["num_failed"] == 0 and r["mode"] == "async"
    # n=3: three choices' tokens per request, each request as long as a plain one at most
    assert by_variant["n"]["total_output_tokens"] > by_variant["plain"]["total_output_tokens"]
    assert by_variant["n"]["total_output_tokens"] <= 3 * 4 * 6
    costs = {c["variant"]: c for c in saved["costs"]}
    assert set(costs) == {"logprobs", "n"}
    for c in costs.values():
        assert c["output_throughput_ratio"] > 0 and c["tpot_mean_ratio"] > 0


def test_request_bodies_per_variant():
    bench = load_bench()
    args = bench.build_parser().parse_args(["--n", "4", "--top-logprobs", "7"])
    plain = bench.request_body("m", "hi", args)
    assert "n" not in plain and "logprobs" not in plain
    assert bench.request_body("m", "hi", args, "logprobs") == plain | {
        "logprobs": True,
        "top_logprobs": 7,
    }
    assert bench.request_body("m", "hi", args, "n") == plain | {"n": 4}
    r = bench.RequestResult(ok=True, latency=1.0, ttft=0.2, output_tokens=9, sequences=3)
    assert r.tpot == pytest.approx(0.8 / 2)  # 3 tokens per choice
