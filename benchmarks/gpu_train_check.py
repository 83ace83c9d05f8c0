"""A few `d3d train` steps at a real model's shape with random weights: tokens/s, peak memory.

The trainer's own step (training/train.py: clean pass, block pass, KL to the target, AdamW)
on a random-weight target built on the device (gpu_shapes.py; nothing downloaded), in bf16
with fp32 master weights for the trainable tensors, over random token sequences. tokens/s
counts the sequences' tokens (prompt and answer) trained per second; peak memory is the most
the GPU held (CUDA), or the process's peak RSS (CPU). Prints one line and writes one JSON
file. Only the timings and memory mean anything.

    python benchmarks/gpu_train_check.py --out benchmarks/results/gpu_train_check.json
    python benchmarks/gpu_train_check.py --device cpu --tiny    # the whole script, in seconds
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from gpu_shapes import SHAPES, build_target

from sglang_d3d.training.distributed import Dist
from sglang_d3d.training.shards import Sample, shard_name, write_manifest, write_shard
from sglang_d3d.training.train import TrainConfig, Trainer


def write_random_sequences(folder: Path, num: int, seq_len: int, vocab: int, seed: int = 0):
    """`num` random sequences of seq_len tokens (a quarter prompt) as one datagen shard."""
    rng = np.random.default_rng(seed)
    p = seq_len // 4
    samples = [Sample(rng.integers(3, vocab, p), rng.integers(3, vocab, seq_len - p), 0, i)
               for i in range(num)]
    folder.mkdir(parents=True, exist_ok=True)
    write_shard(folder / shard_name(0), samples, [True] * num)
    write_manifest(folder, {"shards": [shard_name(0)]})


def train_config(args, data: Path, out: Path, dtype: str) -> TrainConfig:
    return TrainConfig(
        data_dir=str(data), out_dir=str(out), block_size=args.block, min_block_size=4,
        num_anchors=args.anchors, rank=32, alpha=32.0, batch_size=args.batch,
        max_steps=10_000, warmup_steps=1, heldout_every=0, max_seq_len=args.seq_len,
        dtype=dtype, device=args.device, grad_checkpointing=args.grad_checkpointing,
        tensorboard=False, initial_eval=False, threads=args.threads)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def timed_steps(trainer: Trainer, warmup: int, steps: int) -> tuple[list[float], list[dict]]:
    """Seconds of each timed step (after `warmup` untimed ones) and their logged rows."""
    device = torch.device(trainer.device)
    stream = trainer._micro_batches()
    times, rows = [], []
    for i in range(warmup + steps):
        batch = next(stream)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        row = trainer.train_step([batch])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
            rows.append(row)
    return times, rows


def run(args) -> dict:
    shape = SHAPES[args.shape].tiny() if args.tiny else SHAPES[args.shape]
    device = torch.device(args.device)
    dtype = torch.bfloat16
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    target = build_target(shape, device, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        num = args.batch * (args.warmup + args.steps)
        write_random_sequences(Path(tmp) / "data", num, args.seq_len, shape.vocab)
        cfg = train_config(args, Path(tmp) / "data", Path(tmp) / "out", "bfloat16")
        trainer = Trainer(cfg, Dist(device=args.device), target=target)
        masters = {str(p.dtype) for p in trainer.drafter.trainable_parameters()}
        times, rows = timed_steps(trainer, args.warmup, args.steps)
    step_s = float(np.median(times))
    return {
        "shape": asdict(shape), "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "target_dtype": str(dtype), "master_dtype": sorted(masters),
        "batch": args.batch, "seq_len": args.seq_len, "anchors": args.anchors,
        "block": args.block, "grad_checkpointing": args.grad_checkpointing,
        "steps_timed": args.steps, "step_s_median": step_s,
        "tokens_per_s": args.batch * args.seq_len / step_s,
        "peak_memory_gib": peak_memory_gib(device),
        "losses": [r["loss"] for r in rows],
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="toy sizes of the shape (CPU check)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--anchors", type=int, default=32, help="mask blocks per sequence")
    p.add_argument("--block", type=int, default=16, help="the largest block trained")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--threads", type=int, default=4, help="CPU threads")
    p.add_argument("--out", default="benchmarks/results/gpu_train_check.json")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_len, args.anchors, args.block = min(args.seq_len, 64), min(args.anchors, 4), 8
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"train {result['shape']['name']} on {result['gpu'] or result['device']}: "
          f"{result['tokens_per_s']:,.0f} tokens/s ({result['step_s_median'] * 1e3:.0f} ms a "
          f"step of {args.batch} x {args.seq_len}), peak memory "
          f"{result['peak_memory_gib']:.2f} GiB, bf16 target, masters {result['master_dtype']}")
    return result


if __name__ == "__main__":
    main()
