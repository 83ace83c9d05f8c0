"""Evaluation prompt sets: GSM8K test, MT-Bench first turns, MBPP code tasks, or any JSONL file."""

from __future__ import annotations

import json
import os
from pathlib import Path

NAMED = {"gsm8k": "gsm8k/test.jsonl", "mt_bench": "mt_bench/question.jsonl"}
# Shipped with the package (assets/prompts/README.md: source and licence), so the code prompt
# kind needs no download.
BUNDLED = {"mbpp": Path(__file__).resolve().parent / "assets" / "prompts" / "mbpp_1_64.jsonl"}


def datasets_dir() -> Path:
    """$D3D_DATASETS, else the workplace's shared/datasets beside (or inside) the checkout."""
    env = os.environ.get("D3D_DATASETS")
    if env:
        return Path(env)
    root = Path(__file__).resolve().parents[1]
    for cand in (root / "shared" / "datasets", root.parent / "shared" / "datasets"):
        if cand.exists():
            return cand
    raise FileNotFoundError("no datasets folder: set D3D_DATASETS")


def load_questions(dataset: str, limit: int | None = None) -> list[str]:
    path = dataset_path(dataset)
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(question_text(json.loads(line)))
            if limit and len(out) >= limit:
                break
    return out


def dataset_path(dataset: str) -> Path:
    if dataset.endswith(".jsonl"):
        return Path(dataset)
    if dataset in BUNDLED:
        return BUNDLED[dataset]
    if dataset in NAMED:
        return datasets_dir() / NAMED[dataset]
    known = ", ".join(sorted([*NAMED, *BUNDLED]))
    raise ValueError(f"unknown dataset {dataset!r}: one of {known}, or a FILE.jsonl")


def question_text(row: dict) -> str:
    for key in ("question", "prompt"):
        if isinstance(row.get(key), str):
            return row[key]
    if isinstance(row.get("turns"), list) and row["turns"]:
        return row["turns"][0]
    raise ValueError(f"row has no question, prompt or turns field: {sorted(row)}")


def chat_ids(tokenizer, text: str) -> list[int]:
    """The prompt as the target's chat template renders it."""
    msgs = [{"role": "user", "content": text}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)
