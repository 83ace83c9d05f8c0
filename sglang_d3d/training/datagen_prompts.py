"""The datagen prompt list: what the target answers, in the deterministic order shards are cut from.

With `--prompts FILE.jsonl` (repeatable): those files' conversations, file after file, each in
file order (source 2 + i for the i-th file). Without: GSM8K train questions and the built-in
instruction/code mix interleaved (`gsm8k_per_mix` to one), so any prefix of a run is a mixed
data set. GSM8K train is not shipped with the package: it is read from `--gsm8k-path`, else
`$D3D_DATASETS/gsm8k/train.jsonl`; without either the built-in mix alone is used (the bundled
GSM8K test, MT-Bench and MBPP files are evaluation sets and stay out of training data).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from sglang_d3d.training.prompt_files import Conversation, read_prompt_file, single
from sglang_d3d.training.prompt_mix import build_mix

SOURCE_GSM8K, SOURCE_MIX, SOURCE_FILES = 0, 1, 2


@dataclass(frozen=True)
class PromptList:
    items: tuple[tuple[int, Conversation], ...]  # (source, conversation) in shard order
    sources: dict[str, str]  # what each source number is, for the manifest
    skipped: dict[str, int]  # prompt file -> lines without a usable turn
    digest: str = ""  # sha256 of the whole list, before any --max-prompts cap

    def fingerprint(self) -> str:
        """A resumed run must cut shards from the same list; a cap may change."""
        return self.digest or digest(self.items)


def digest(items) -> str:
    h = hashlib.sha256()
    for source, conv in items:
        h.update(json.dumps([source, conv.to_json()], sort_keys=True).encode())
    return h.hexdigest()


def gsm8k_train_path(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    env = os.environ.get("D3D_DATASETS")
    if env and (Path(env) / "gsm8k" / "train.jsonl").is_file():
        return str(Path(env) / "gsm8k" / "train.jsonl")
    return None


def load_gsm8k_questions(path: str) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["question"] for line in f if line.strip()]


def interleave(a: list, b: list, a_per_b: int) -> list[tuple[int, object]]:
    """[(0, a0), (0, a1), (1, b0), ...]: `a_per_b` items of a, then one of b, until both run out."""
    out, ia, ib = [], 0, 0
    while ia < len(a) or ib < len(b):
        for _ in range(a_per_b):
            if ia < len(a):
                out.append((0, a[ia]))
                ia += 1
        if ib < len(b):
            out.append((1, b[ib]))
            ib += 1
    return out


def default_list(gsm8k_path: str | None, gsm8k_per_mix: int, seed: int) -> PromptList:
    gsm = load_gsm8k_questions(gsm8k_path) if gsm8k_path else []
    items = tuple((src, single(q)) for src, q in interleave(gsm, build_mix(seed), gsm8k_per_mix))
    sources = {str(SOURCE_MIX): "sglang_d3d.training.prompt_mix"}
    if gsm8k_path:
        sources[str(SOURCE_GSM8K)] = f"gsm8k train ({Path(gsm8k_path).name})"
    return PromptList(items, sources, {})


def files_list(paths: tuple[str, ...]) -> PromptList:
    """Raises PromptFileError for a missing file or one without a usable turn."""
    items, sources, skipped = [], {}, {}
    for i, path in enumerate(paths):
        pf = read_prompt_file(path)
        items += [(SOURCE_FILES + i, c) for c in pf.conversations]
        sources[str(SOURCE_FILES + i)] = Path(path).name
        skipped[Path(path).name] = pf.num_skipped
    return PromptList(tuple(items), sources, skipped)


def build_prompt_list(prompt_files: tuple[str, ...], gsm8k_path: str | None, gsm8k_per_mix: int,
                      seed: int, max_prompts: int | None) -> PromptList:
    pl = (files_list(prompt_files) if prompt_files
          else default_list(gsm8k_path, gsm8k_per_mix, seed))
    if max_prompts:
        pl = PromptList(pl.items[:max_prompts], pl.sources, pl.skipped, digest(pl.items))
    return pl
