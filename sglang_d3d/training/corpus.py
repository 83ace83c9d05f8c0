"""Write the target's answers from `d3d datagen` shards into a drafter folder, for copies.

    d3d corpus --data data/distill --drafter sglang_d3d/assets/drafter

The engine then copies what the target most often said after a row's last few tokens where
the row's own text has no copy (speculative/corpus_lookup.py, `--corpus-tokens`). The answers
are the target's greedy outputs, its prompts are not: a copy guesses what the target says.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sglang_d3d.models.corpus import first_tokens, write_corpus
from sglang_d3d.models.drafter import read_config
from sglang_d3d.training.shards import read_manifest, read_shard


def add_corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="a `d3d datagen` output folder (manifest.json "
                   "and its shards)")
    p.add_argument("--drafter", required=True, help="the drafter folder to write corpus.npz into "
                   "(its config names the target the answers must come from)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="keep the first answers up to this many tokens (default: all)")


def run_corpus(args: argparse.Namespace) -> int:
    data, folder = Path(args.data), Path(args.drafter)
    manifest = read_manifest(data)
    if not manifest.get("shards"):
        raise SystemExit(f"{data}: no datagen shards listed (manifest.json); run d3d datagen first")
    if not (folder / "config.json").exists():
        raise SystemExit(f"{folder}: not a drafter folder (no config.json)")
    cfg = read_config(folder)
    target = manifest.get("target")
    answers = [s.response for name in manifest["shards"] for s in read_shard(data / name)]
    if args.max_tokens is not None:
        answers = first_tokens(answers, args.max_tokens)
    path = write_corpus(folder, answers, cfg.target_fingerprint)
    print(f"wrote {path}: {len(answers)} answers, {sum(map(len, answers))} tokens"
          + (f" (datagen target {target})" if target else ""))
    return 0
