"""benchmarks/gpu_train_check.py runs end to end on CPU (--device cpu --tiny): the trainer's
own steps at a shape's structure, bf16 target with fp32 master weights. The GPU numbers come
from benchmarks/gpu_check.sh."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_train_check  # noqa: E402


def test_the_training_check_runs_on_cpu_with_a_tiny_shape(tmp_path):
    out = tmp_path / "train.json"
    gpu_train_check.main(["--device", "cpu", "--tiny", "--steps", "2", "--warmup", "1",
                          "--threads", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["shape"]["family"] == "qwen3" and saved["target_dtype"] == "torch.bfloat16"
    assert saved["master_dtype"] == ["torch.float32"]
    assert saved["tokens_per_s"] > 0 and saved["peak_memory_gib"] > 0
    assert len(saved["losses"]) == 2 and all(math.isfinite(x) for x in saved["losses"])
