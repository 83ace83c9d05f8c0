"""The own-target pipeline's commands end to end on a device, on a tiny random target.

`d3d datagen` (embedded engine on --device) -> `torchrun --nproc_per_node 1 -m sglang_d3d train`
(bf16 with fp32 masters, evaluation on the device, gradient checkpointing) -> `d3d bench` with
the trained drafter. Each command's exit status, its last lines and the bench's greedy check
go to one JSON file. The tiny model says nothing about speed; this checks that the CUDA paths
of the three commands run.

    python benchmarks/gpu_pipeline_check.py --out benchmarks/results/gpu_pipeline_check.json
    python benchmarks/gpu_pipeline_check.py --device cpu     # the same commands on a CPU
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sglang_d3d.testing import make_tiny_target

PROMPTS = [{"prompt": f"w{i} w{i + 7} w{i + 3}"} for i in range(5, 17)]
PROMPTS.append({"conversations": [{"from": "human", "value": "w5 w6"},
                                  {"from": "gpt", "value": "w7"},
                                  {"from": "human", "value": "w8 w9"}]})


def step(name: str, argv: list[str], timeout: float) -> dict:
    """Run one command; its status, seconds and last lines of output."""
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                           timeout=timeout)
        rc, out = p.returncode, (p.stdout + p.stderr)
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {timeout} s: {e}"
    row = {"step": name, "rc": rc, "seconds": round(time.perf_counter() - t, 1),
           "tail": out.strip().splitlines()[-6:]}
    print(f"[pipeline] {name}: rc {rc} in {row['seconds']} s", flush=True)
    if rc:
        print("\n".join(row["tail"]), flush=True)
    return row


def commands(root: Path, target: str, device: str) -> list[tuple[str, list[str]]]:
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    data, run, bench = root / "data", root / "run", root / "bench.json"
    return [
        ("datagen", ["-m", "sglang_d3d", "datagen", "--target", target, "--prompts",
                     str(prompts), "--out-dir", str(data), "--max-new-tokens", "24",
                     "--shard-size", "4", "--device", device, "--dtype", "float32"]),
        ("train", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                   "-m", "sglang_d3d", "train", "--target", target, "--data-dir", str(data),
                   "--out-dir", str(run), "--device", device, "--dtype", "bfloat16",
                   "--grad-checkpointing", "--block-size", "4", "--num-anchors", "3",
                   "--rank", "4", "--alpha", "4", "--batch-size", "4", "--max-steps", "6",
                   "--warmup-steps", "1", "--heldout-every", "4", "--eval-every", "3",
                   "--eval-samples", "2", "--no-tensorboard"]),
        ("bench", ["-m", "sglang_d3d", "bench", "--target", target, "--drafter",
                   str(run / "drafter"), "--dataset", str(prompts), "--num-prompts", "4",
                   "--max-new-tokens", "16", "--block-size", "4", "--modes", "ar,sync,async",
                   "--device", device, "--dtype", "float32", "--out", str(bench)]),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=float, default=150, help="seconds per command")
    p.add_argument("--out", default="benchmarks/results/gpu_pipeline_check.json")
    args = p.parse_args(argv)
    rows, report = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = make_tiny_target(root / "target", arch="qwen3")
        for name, cmd in commands(root, target, args.device):
            rows.append(step(name, cmd, args.timeout))
            if rows[-1]["rc"]:
                break
        if (root / "bench.json").exists():
            report = json.loads((root / "bench.json").read_text())
    result = {"device": args.device, "steps": rows,
              "greedy_identical": report.get("greedy_identical")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"[pipeline] greedy identical: {result['greedy_identical']}; wrote {args.out}")
    return max(r["rc"] for r in rows)


if __name__ == "__main__":
    sys.exit(main())
