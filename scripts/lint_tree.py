"""Text lint for what ruff does not read: JSON, YAML, TOML, shell, Markdown and other config files.

Fails (exit 1, one line per hit) where a tracked file names one machine's home or work folder,
carries words about how the project was made rather than what it does, or is JSON that does not
parse. The bundled prompt
sets are data written by others and are not read.

    python scripts/lint_tree.py            # every tracked text file
    python scripts/lint_tree.py FILE ...   # these files
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

# Written with character classes so this file does not match itself.
RULES = (
    ("a machine path", re.compile(r"[/](?:work|root|home|Users)[/]")),
    ("a process word", re.compile(r"\bsit[t]ing|session[-_ ]minutes", re.IGNORECASE)),
)
SUFFIXES = {".json", ".yaml", ".yml", ".toml", ".cfg", ".cff", ".ini", ".sh", ".md", ".txt",
            ".py", ".tpl", ".gitignore", ""}
SKIP_UNDER = ("sglang_d3d/assets/prompts/",)


def hits(text: str) -> list[tuple[int, str]]:
    """(line number, rule) for every line of `text` a rule matches."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        found.extend((number, name) for name, rule in RULES if rule.search(line))
    return found


def tracked_files(root: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                         check=True).stdout.split()
    return [root / p for p in out
            if not p.startswith(SKIP_UNDER) and Path(p).suffix in SUFFIXES]


def lint(paths: list[Path]) -> list[str]:
    problems = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        problems.extend(f"{path}:{n}: {name}" for n, name in hits(text))
        if path.suffix == ".json":
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                problems.append(f"{path}:{e.lineno}: JSON that does not parse ({e.msg})")
    return problems


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    paths = [Path(a) for a in argv] if argv else tracked_files(root)
    problems = lint(paths)
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
