"""A full-depth drafter inside real SGLang on CPU shares the target (sglang_worker/pool_draft.py,
shared_cycle.py): the worker's own counters, written by SGLang's scheduler process
(sglang_worker/counters.py), show what each cycle did. Tiny random full-depth pair, torch_native
attention. Skipped where sglang is not installed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]

PROMPTS = [[1, 5, 36, 77, 8], [1, 9, 50, 11, 62, 13, 24], [1, 40, 41]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def run(tmp_path_factory, sglang_baseline_cache):
    from sglang_d3d.sglang_worker.cpu_harness import subprocess_env
    from sglang_d3d.sglang_worker.cpu_harness.tiny import make_pair

    root = tmp_path_factory.mktemp("shared")
    target, drafter = make_pair(root, block_size=4, full_depth=True)
    counters = root / "counters.json"
    # sync: every cycle speculates (the plan per load would also run plain cycles)
    env = {**subprocess_env(), "SGLANG_D3D_COUNTERS_FILE": str(counters),
           "SGLANG_D3D_BASELINE_CACHE": sglang_baseline_cache,
           "SGLANG_D3D_MODE": "sync"}
    cmd = [sys.executable, "-m", "sglang_d3d.sglang_worker.cpu_harness.compare", target, drafter,
           json.dumps(PROMPTS), str(MAX_NEW)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("COMPARE-RESULT ")]
    assert lines, f"run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1].removeprefix("COMPARE-RESULT "))
    result["counters"] = json.loads(counters.read_text())
    return result


def test_greedy_output_equals_sglang_alone(run):
    d3d = [run["d3d"][f"g{i}"] for i in range(len(PROMPTS))]
    assert all(r["error"] is None for r in d3d)
    assert [r["ids"] for r in d3d] == run["baseline"]
    # At full depth the anchor is the target itself: draft 1 is the target's own token.
    assert all(n >= 2 for r in d3d for n in r["accepted_lengths"])


def test_sampled_requests_finish(run):
    for i in range(len(PROMPTS)):
        r = run["sampled"][f"s{i}"]
        assert r["error"] is None and r["reason"] in ("length", "stop") and r["ids"]


def test_the_drafter_never_prefills(run):
    c = run["counters"]
    assert c["cycles"] > 0 and c["drafter_passes"] == c["cycles"] and c["plain_steps"] == 0
    assert c["drafter_prefill_tokens"] == 0


def test_the_drafter_holds_no_copy_of_a_target_layer(run):
    c = run["counters"]
    assert c["drafter_shares_target"] and c["target_layer_copies"] == 0
    # Its own tensors are the deltas and the mask embedding: far less than one layer's copy.
    assert 0 < c["drafter_bytes"] < 1 << 20


def test_one_target_pass_and_one_metadata_plan_per_cycle(run):
    c = run["counters"]
    assert c["target_passes"] == c["cycles"]
    assert c["metadata_plans"] == c["cycles"]


def test_at_most_one_host_copy_per_cycle(run):
    c = run["counters"]
    assert c["host_copies"] <= c["cycles"]
