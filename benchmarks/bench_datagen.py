"""Datagen throughput: the embedded engine against `d3d datagen --server` on `d3d serve`.

The same prompts (the first N questions of the bundled GSM8K test file), the same answer
length, the default target (SmolLM2-135M-Instruct) on the same CPU threads, greedy:
  embedded   `d3d datagen` with no server: the engine's target runner in `ar` mode,
             continuous batching of all N prompts at once
  server     `d3d serve --mode async` (the default drafter) started here, then
             `d3d datagen --server URL --concurrency C`
The server runs first (its start-up, calibration included, is not counted), then, once it has
stopped, the embedded run (its model load is counted; `generation_seconds` leaves it out, and
leaves out the server run's tokenizer probes). Tokens/s = response tokens stored / wall
seconds of the datagen call. Also reported: how many answers are identical
token for token between the two (both are the target's greedy answers; float near-ties between
batch shapes may flip a few).

    .venv/bin/python benchmarks/bench_datagen.py --num-prompts 16 --max-new-tokens 128 \
        --concurrency 8 --threads 2 --out benchmarks/results/datagen.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sglang_d3d.training.datagen import DatagenConfig, run_datagen_config
from sglang_d3d.training.shards import load_samples

PROMPTS = Path(__file__).resolve().parents[1] / "sglang_d3d" / "assets" / "prompts" / "gsm8k_test.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(mode: str, threads: int, port: int, max_batch: int,
                 timeout: float) -> subprocess.Popen:
    """`d3d serve` with its defaults (the adaptive controller calibrates before serving)."""
    cmd = [sys.executable, "-m", "sglang_d3d.cli", "serve", "--mode", mode, "--port", str(port),
           "--threads", str(threads), "--max-batch-size", str(max_batch), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"d3d serve exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise TimeoutError("d3d serve did not become healthy")


def timed_run(cfg: DatagenConfig) -> dict:
    t0 = time.perf_counter()
    m = run_datagen_config(cfg)
    seconds = time.perf_counter() - t0
    tokens = m["num_response_tokens"]
    return {"response_tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 2), "samples": m["num_samples"],
            # without model loading (embedded) or the tokenizer probes (server)
            "generation_seconds": m["seconds"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="CPU threads for either generator")
    p.add_argument("--server-mode", default="async", help="d3d serve --mode")
    p.add_argument("--start-timeout", type=float, default=1800,
                   help="seconds the server may take to start (calibration included)")
    p.add_argument("--out", default="benchmarks/results/datagen.json")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_datagen_"))
    common = dict(prompt_files=(str(PROMPTS),), max_prompts=args.num_prompts,
                  max_new_tokens=args.max_new_tokens, shard_size=args.num_prompts)
    port = free_port()
    proc = start_server(args.server_mode, args.threads, port, args.concurrency, args.start_timeout)
    try:
        srv_cfg = DatagenConfig(out_dir=str(tmp / "server"), server=f"http://127.0.0.1:{port}",
                                concurrency=args.concurrency, **common)
        server = timed_run(srv_cfg)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"server ({args.server_mode}, concurrency {args.concurrency}): {server}")
    emb_cfg = DatagenConfig(out_dir=str(tmp / "embedded"), batch_size=args.num_prompts,
                            threads=args.threads, **common)
    embedded = timed_run(emb_cfg)  # after the server has stopped: the CPU is its alone
    print(f"embedded: {embedded}")
    a, b = load_samples(tmp / "embedded"), load_samples(tmp / "server")
    same = sum(x.response.tolist() == y.response.tolist() for x, y in zip(a, b, strict=True))
    result = {
        "what": "d3d datagen tokens/s: embedded engine vs d3d serve through --server",
        "target": "SmolLM2-135M-Instruct (default)",
        "prompts": f"first {args.num_prompts} of {PROMPTS.name}",
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs",
        "embedded": {"command": f"d3d datagen --prompts {PROMPTS.name} --max-prompts "
                                f"{args.num_prompts} --max-new-tokens {args.max_new_tokens} "
                                f"--batch-size {args.num_prompts} --threads {args.threads}",
                     **embedded},
        "server": {"command": f"d3d serve --mode {args.server_mode} --threads {args.threads} "
                              f"--max-batch-size {args.concurrency}; d3d datagen --server URL "
                              f"--concurrency {args.concurrency} (same prompts and length)",
                   **server},
        "speedup": round(server["tokens_per_s"] / embedded["tokens_per_s"], 2),
        "identical_responses": f"{same} of {len(a)}",
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
