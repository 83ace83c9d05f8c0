"""Offline greedy acceptance length of a drafter on evaluation prompts, per block position.

The target answers each prompt greedily (continuous batching on the project's runner; cached
under runs/accept_cache/ by dataset and length), then the drafter drafts blocks at random
anchors of each response exactly as in training's held-out evaluation (training/evaluate.py):
accepted length = leading drafts equal to the target's own continuation, + 1.

    .venv/bin/python benchmarks/bench_accept.py --drafter sglang_d3d/assets/drafter \
        --dataset gsm8k --num-prompts 30 --blocks 16,8 --threads 1 \
        --out benchmarks/results/accept_gsm8k.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from sglang_d3d.models.drafter import D3DDrafter
from sglang_d3d.models.loading import load_tokenizer, resolve_target_path
from sglang_d3d.prompts import chat_ids, load_questions
from sglang_d3d.training.build import load_target
from sglang_d3d.training.evaluate import acceptance_length
from sglang_d3d.training.generation import generate_continuous
from sglang_d3d.training.shards import Sample

CACHE = Path("runs/accept_cache")


def target_samples(target, tok, dataset: str, n: int, max_new: int) -> list[Sample]:
    """Greedy target responses to the first n prompts of `dataset` (cached)."""
    path = CACHE / f"{Path(dataset).stem}_{n}_{max_new}.json"
    if path.exists():
        rows = json.loads(path.read_text())
    else:
        prompts = [chat_ids(tok, q) for q in load_questions(dataset, n)]
        eos = {tok.eos_token_id} | set(np.atleast_1d(target.hf_config.eos_token_id).tolist())
        out = generate_continuous(target, prompts, max_new, eos, num_slots=min(16, n))
        rows = [[p, r] for p, (r, _) in zip(prompts, out)]
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows))
    return [Sample(np.array(p), np.array(r), 0, i) for i, (p, r) in enumerate(rows)]


def add_sample_args(p: argparse.ArgumentParser, anchors: int, threads: int) -> None:
    """The options of a benchmark that drafts on the target's answers (this one and
    bench_int8_accuracy.py)."""
    p.add_argument("--dataset", default="gsm8k", help="gsm8k | mt_bench | mbpp (code, bundled) | FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--anchors", type=int, default=anchors, help="blocks drafted per response")
    p.add_argument("--threads", type=int, default=threads)
    p.add_argument("--out", default=None)


def load_pair(a: argparse.Namespace, drafter_path) -> tuple[D3DDrafter, list[Sample]]:
    """The default target, the drafter at `drafter_path`, and the target's answers."""
    load_questions(a.dataset, 1)  # a bad --dataset fails before the models load
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    target = load_target(None)
    tok = load_tokenizer(resolve_target_path(None))
    drafter = D3DDrafter.from_pretrained(drafter_path, target).eval()
    return drafter, target_samples(target, tok, a.dataset, a.num_prompts, a.max_new_tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True)
    p.add_argument("--blocks", default="16,8")
    add_sample_args(p, anchors=8, threads=1)
    a = p.parse_args()
    drafter, samples = load_pair(a, a.drafter)
    report = {"dataset": a.dataset, "num_prompts": a.num_prompts, "drafter": a.drafter,
              "drafter_config": json.loads((Path(a.drafter) / "config.json").read_text()),
              "blocks": {}}
    for block in [int(b) for b in a.blocks.split(",")]:
        r = acceptance_length(drafter, samples, block, a.anchors)
        report["blocks"][block] = {"accept_len": r.mean, "by_position": r.by_position,
                                   "num_blocks": r.num_blocks}
        pos = " ".join(f"{x:.2f}" for x in r.by_position)
        print(f"{a.dataset} block {block}: accepted length {r.mean:.3f} over {r.num_blocks} "
              f"blocks; P(draft d accepted), d = 1..{block - 1}: {pos}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
