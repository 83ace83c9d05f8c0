"""D3D inside real SGLang with two tensor-parallel ranks on CPU (gloo): every rank runs its own
drafter and verification, and the worker broadcasts rank 0's verify block and verdicts
(cycle_step.from_rank0), as SGLang's DFlash worker syncs its decisions. Greedy output must equal
SGLang's own at --tp-size 2; sampled requests must finish (a rank that verified or committed
other tokens would hang the next collective or change the output)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from engine_helpers import finished_whole

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores"),
]

PROMPTS = [[1, 5, 36, 77, 8], [1, 9, 50, 11, 62, 13, 24]]
MAX_NEW = 16


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from sglang_d3d.sglang_worker.cpu_harness import subprocess_env
    from sglang_d3d.sglang_worker.cpu_harness.tiny import make_pair

    target, drafter = make_pair(tmp_path_factory.mktemp("pair"), block_size=4)
    # SGLang's CPU path puts one rank per NUMA node unless told which cores each rank uses.
    env = {**subprocess_env(), "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    cmd = [sys.executable, "-m", "sglang_d3d.sglang_worker.cpu_harness.compare", target, drafter,
           json.dumps(PROMPTS), str(MAX_NEW), "cpu", "float32", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("COMPARE-RESULT ")]
    assert lines, f"run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("COMPARE-RESULT "))


def test_greedy_at_two_ranks_equals_sglang_alone(run):
    d3d = [run["d3d"][f"g{i}"] for i in range(len(PROMPTS))]
    assert all(r["error"] is None and r["reason"] == "length" for r in d3d)
    assert [r["ids"] for r in d3d] == run["baseline"]
    assert any(n > 1 for r in d3d for n in r["accepted_lengths"])


def test_sampled_requests_finish_at_two_ranks(run):
    for i in range(len(PROMPTS)):
        r = run["sampled"][f"s{i}"]
        assert finished_whole(r, MAX_NEW)
