"""Evaluation prompt sets: GSM8K test, MT-Bench first turns, MBPP code tasks, or any JSONL file.

A FILE.jsonl may hold any shape `d3d datagen --prompts` reads (training/prompt_files.py):
ShareGPT `conversations`, OpenAI `messages`, MT-Bench `turns`, or a plain `prompt` /
`question`. A benchmark asks each conversation's first user turn, after its system turn if it
has one; lines with no user turn, or that are not JSON, are skipped and counted.
"""

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


# One benchmark prompt: the user's text, or a chat (a system turn, then the user turn).
Prompt = str | tuple[dict, ...]


def load_questions(dataset: str, limit: int | None = None) -> list[Prompt]:
    """The first `limit` prompts of a named set or a FILE.jsonl (see the module's note)."""
    path = dataset_path(dataset)
    if dataset.endswith(".jsonl"):
        return _file_prompts(path, limit)
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(question_text(json.loads(line)))
            if limit and len(out) >= limit:
                break
    return out


def _file_prompts(path: Path, limit: int | None) -> list[Prompt]:
    from sglang_d3d.training.prompt_files import read_prompt_file

    pf = read_prompt_file(path)  # PromptFileError (a ValueError) names the file
    convs = pf.conversations[:limit] if limit else pf.conversations
    multi = sum(len(c.user_turns) > 1 for c in convs)
    print(f"{path}: {len(convs)} prompt(s), each a conversation's first user turn"
          + (f" ({multi} with later turns not asked)" if multi else "")
          + (f"; {pf.num_skipped} line(s) skipped: not JSON or no user turn"
             if pf.num_skipped else ""))
    return [c.user_turns[0] if c.system is None else tuple(c.messages([])) for c in convs]


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
    """A row's first user turn, in any shape datagen reads."""
    from sglang_d3d.training.prompt_files import conversation_of

    conv = conversation_of(row)
    if conv is None:
        raise ValueError(
            f"row has no user turn: {sorted(row) if isinstance(row, dict) else type(row).__name__}"
            " (expected `conversations`, `messages`, `turns`, `prompt` or `question`)")
    return conv.user_turns[0]


def chat_ids(tokenizer, prompt: Prompt, template_kwargs: dict | None = None) -> list[int]:
    """The prompt as the target's chat template renders it; `template_kwargs`: options for the
    template (Qwen3's enable_thinking, for one)."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode("\n\n".join(m["content"] for m in msgs))
