"""SGLANG_D3D_MODE=fused inside real SGLang on CPU (sglang_worker/fused_cycle.py): every cycle
is one forward of SGLang's target that verifies the block and drafts the next one. Greedy output
equals SGLang alone, sampled requests finish, and the worker's counters (written by SGLang's
scheduler process, sglang_worker/counters.py) show one target pass, one metadata plan, no
drafter pass and no drafter prefill per cycle. Two branch budgets: a branch at every outcome
(no host copy at all) and two branches (misses, and one host copy a cycle). Tiny random
full-depth pair, torch_native attention. Skipped where sglang is not installed."""

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


@pytest.fixture(scope="module", params=["4", "2"], ids=["every-outcome", "two-branches"])
def run(request, tmp_path_factory, sglang_baseline_cache):
    from sglang_d3d.sglang_worker.cpu_harness import subprocess_env
    from sglang_d3d.sglang_worker.cpu_harness.tiny import make_pair

    root = tmp_path_factory.mktemp("fused")
    target, drafter = make_pair(root, block_size=4, full_depth=True)
    counters = root / "counters.json"
    env = {**subprocess_env(), "SGLANG_D3D_COUNTERS_FILE": str(counters),
           "SGLANG_D3D_BASELINE_CACHE": sglang_baseline_cache,
           "SGLANG_D3D_MODE": "fused", "SGLANG_D3D_BRANCH_BUDGET": request.param}
    cmd = [sys.executable, "-m", "sglang_d3d.sglang_worker.cpu_harness.compare", target, drafter,
           json.dumps(PROMPTS), str(MAX_NEW)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("COMPARE-RESULT ")]
    assert lines, f"run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1].removeprefix("COMPARE-RESULT "))
    result["counters"] = json.loads(counters.read_text())
    result["branches"] = int(request.param)
    return result


def test_greedy_output_equals_sglang_alone(run):
    d3d = [run["d3d"][f"g{i}"] for i in range(len(PROMPTS))]
    assert all(r["error"] is None for r in d3d)
    assert [r["ids"] for r in d3d] == run["baseline"]


def test_sampled_requests_finish(run):
    for i in range(len(PROMPTS)):
        r = run["sampled"][f"s{i}"]
        assert r["error"] is None and r["reason"] in ("length", "stop") and r["ids"]


def test_every_cycle_is_one_fused_forward(run):
    c = run["counters"]
    assert c["cycles"] > 0 and c["fused_steps"] == c["cycles"] and c["plain_steps"] == 0
    assert c["target_passes"] == c["cycles"]  # the drafting rode in the target's pass
    assert c["drafter_passes"] == 0 and c["drafter_prefill_tokens"] == 0
    assert c["metadata_plans"] == c["cycles"]


def test_the_drafter_holds_no_copy_of_a_target_layer(run):
    c = run["counters"]
    assert c["drafter_shares_target"] and c["target_layer_copies"] == 0


def test_host_copies(run):
    c = run["counters"]
    if run["branches"] >= 4:  # a branch at every outcome: nothing to bring back
        assert c["host_copies"] == 0
    else:
        assert c["host_copies"] == c["cycles"]  # which rows hit, and the drafts' odds
