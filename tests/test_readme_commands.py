"""The README's SGLang launch lines are docs/sglang.md's own, word for word, so the checks that
run docs/sglang.md's commands through SGLang's parser and the memory plan
(tests/test_sglang_docs_commands.py) hold for what the README shows too."""

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def launch_lines(path: Path) -> list[str]:
    """Every D3D launch command in the file's bash blocks (SGLang's server with D3D, or
    `d3d serve --backend sglang`), continuations joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line.strip().removeprefix("- ").strip(), comments=True)
            text = " ".join(words)
            if ("sglang.launch_server" in text and "D3D" in text) or "--backend sglang" in text:
                out.append(text)
    return out


def test_the_readme_shows_both_launch_forms():
    lines = launch_lines(ROOT / "README.md")
    assert any("sglang.launch_server" in x for x in lines)
    assert any(x.startswith("d3d serve --backend sglang") for x in lines)


def test_every_readme_launch_line_is_one_of_docs_sglang():
    docs = set(launch_lines(ROOT / "docs" / "sglang.md"))
    missing = [x for x in launch_lines(ROOT / "README.md") if x not in docs]
    assert not missing, f"README launch lines not in docs/sglang.md: {missing}"
