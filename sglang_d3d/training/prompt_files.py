"""The user's own prompts for `d3d datagen --prompts FILE.jsonl`, in the common chat shapes.

One JSON object per line, in any of:
  ShareGPT  {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}
  OpenAI    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
  turns     {"turns": ["first user turn", "second user turn"]}   (MT-Bench's shape)
  plain     {"prompt": "..."}   (or {"question": "..."}, GSM8K's shape)

Only the user turns (and a system turn) are kept: the target regenerates every assistant turn,
each conditioned on its own earlier answers, so the data's answers are never the labels. A line
without a user turn, or with roles the target's chat template may not take (tools, functions),
is skipped and counted; a file with no usable line is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

USER_NAMES = {"human", "user"}
ASSISTANT_NAMES = {"gpt", "assistant", "chatgpt", "bard", "bing", "model"}
SYSTEM_NAMES = {"system"}


class PromptFileError(ValueError):
    """A prompt file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Conversation:
    """What the target is asked: an optional system turn, then one or more user turns. The
    target answers each user turn in order."""

    user_turns: tuple[str, ...]
    system: str | None = None

    def messages(self, answers: list[str]) -> list[dict]:
        """The chat up to the next user turn, with the target's own `answers` before it."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for k, user in enumerate(self.user_turns[: len(answers) + 1]):
            out.append({"role": "user", "content": user})
            if k < len(answers):
                out.append({"role": "assistant", "content": answers[k]})
        return out

    def to_json(self) -> dict:
        return {"system": self.system, "user_turns": list(self.user_turns)}


def single(question: str) -> Conversation:
    return Conversation((question,))


def _text(content) -> str | None:
    """A message's text: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return None


def _role(name) -> str | None:
    name = str(name).lower()
    for role, names in (("user", USER_NAMES), ("assistant", ASSISTANT_NAMES),
                        ("system", SYSTEM_NAMES)):
        if name in names:
            return role
    return None


def _from_turns(turns: list[tuple[str | None, str | None]]) -> Conversation | None:
    """(role, text) pairs -> Conversation; None where a turn is unusable or no user turn."""
    system, users = None, []
    for role, text in turns:
        if role is None or text is None:
            return None
        if role == "system":
            if users or system is not None:
                return None  # a system turn mid-conversation: not a shape templates agree on
            system = text
        elif role == "user":
            if not text.strip():
                return None
            users.append(text)
    return Conversation(tuple(users), system) if users else None


def conversation_of(row) -> Conversation | None:
    """One JSONL row in any supported shape; None if it has no usable user turn."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("conversations"), list):
        turns = row["conversations"]
        return _from_turns([(_role(t.get("from")), _text(t.get("value"))) if isinstance(t, dict)
                            else (None, None) for t in turns])
    if isinstance(row.get("messages"), list):
        turns = row["messages"]
        return _from_turns([(_role(t.get("role")), _text(t.get("content"))) if isinstance(t, dict)
                            else (None, None) for t in turns])
    turns = row.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns):
        return Conversation(tuple(turns))  # MT-Bench's shape: the user turns alone
    for key in ("prompt", "question"):
        if isinstance(row.get(key), str) and row[key].strip():
            return single(row[key])
    return None


@dataclass(frozen=True)
class PromptFile:
    path: str
    conversations: tuple[Conversation, ...]
    num_skipped: int  # lines without a usable user turn


def read_prompt_file(path: str | Path) -> PromptFile:
    """Every usable conversation of a JSONL file, in file order. Raises PromptFileError."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: no such prompt file")
    convs, skipped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                conv = conversation_of(json.loads(line))
            except json.JSONDecodeError:
                conv = None
            if conv is None:
                skipped += 1
            else:
                convs.append(conv)
    if not convs:
        raise PromptFileError(
            f"{path}: no usable turn in {skipped} line(s); expected JSON lines with "
            "`conversations` (ShareGPT), `messages` (OpenAI) or `prompt`, each with a user turn"
        )
    return PromptFile(str(path), tuple(convs), skipped)
