"""D3D inside real SGLang on a CUDA GPU (skipped without one; SGLang installed with its CUDA
stack: pip install '.[sglang]' in a clone). The same end-to-end run as the CPU test, no test
harness, SGLang's real sgl-kernel, on two attention backends: triton in float32, and SGLang's
default choice for the GPU (fa3 on Hopper) in float16, since fa3 takes no float32. Under
float16 a block verified at once and tokens decoded one by one round differently; a greedy
mismatch there is a numerics question before it is a worker one."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]

BLOCK = 4


@pytest.fixture(scope="module", params=["triton", "default"])
def run(request, tmp_path_factory):
    from sglang_d3d.sglang_worker.cpu_harness.tiny import make_pair

    pair = make_pair(tmp_path_factory.mktemp("pair"), block_size=BLOCK)
    cmd = [
        sys.executable,
        "-m",
        "sglang_d3d.sglang_worker.cpu_harness.e2e",
        *pair,
        str(BLOCK),
        "cuda",
        request.param,  # attention backend
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("E2E-RESULT ")]
    assert lines, f"e2e run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("E2E-RESULT "))


def test_greedy_d3d_equals_sglang_without_speculation_on_cuda(run):
    d3d = [run["d3d"][f"g{i}"] for i in range(len(run["prompts"]))]
    assert [r["ids"] for r in d3d] == run["baseline"]
    assert any(n > 1 for r in d3d for n in r["accepted_lengths"])


def test_unverifiable_request_is_refused_on_cuda(run):
    assert run["refused"]["finish"]["type"] == "abort"
