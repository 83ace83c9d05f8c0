"""Evaluation prompt sets: GSM8K test, MT-Bench first turns, MBPP code tasks, or any JSONL file."""

from __future__ import annotations

import json
import os
from pathlib import Path

# The sets `$D3D_DATASETS` may override, by their path inside that folder.
NAMED = {"gsm8k": "gsm8k/test.jsonl", "mt_bench": "mt_bench/question.jsonl"}
_ASSETS = Path(__file__).resolve().parent / "assets" / "prompts"
# Shipped with the package (assets/prompts/README.md: sources and licences), so every named set
# works from any clone with nothing to download.
BUNDLED = {
    "gsm8k": _ASSETS / "gsm8k_test.jsonl",
    "mt_bench": _ASSETS / "mt_bench.jsonl",
    "mbpp": _ASSETS / "mbpp_1_64.jsonl",
}


def datasets_dir() -> Path | None:
    """The override folder `$D3D_DATASETS`, or None when unset."""
    env = os.environ.get("D3D_DATASETS")
    return Path(env) if env else None


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
    override = datasets_dir()
    if override is not None and dataset in NAMED:
        path = override / NAMED[dataset]
        if not path.is_file():
            raise FileNotFoundError(f"D3D_DATASETS is set but {path} does not exist")
        return path
    if dataset in BUNDLED:
        return BUNDLED[dataset]
    known = ", ".join(sorted(BUNDLED))
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
