"""llama.cpp's own decode loop (benchmarks/llama_decode.cpp) driven from Python, one process.

The program loads the GGUF once, then answers one request per line: greedy decoding of given
prompt token ids, timed inside C++ (time to the first token, whole answer, decode tokens/s).
bench_peers.py's `llama-cpp` row runs it beside llama-cpp-python's loop on the same library.

    bash scripts/build_llama_decode.sh    # -> .llama/build/llama_decode
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

DEFAULT_BINARY = Path(__file__).resolve().parents[1] / ".llama" / "build" / "llama_decode"
ANSWER_KEYS = ("prompt_tokens", "ttft_s", "seconds", "decode_tokens_per_s", "token_ids")


def command(binary: Path, model: Path, threads: int, eos: tuple[int, ...]) -> list[str]:
    cmd = [str(binary), "--model", str(model), "--threads", str(threads)]
    return cmd + (["--eos", ",".join(map(str, eos))] if eos else [])


def request_line(ids: list[int], max_new_tokens: int) -> str:
    """`N ID ID ...`: at most N new tokens after the prompt `ids`."""
    if max_new_tokens < 1 or not ids:
        raise ValueError("a request needs max_new_tokens >= 1 and at least one prompt token")
    return " ".join(map(str, [max_new_tokens, *ids])) + "\n"


def parse_answer(line: str) -> dict:
    """One JSON answer line; a missing field is an error rather than a silent zero."""
    answer = json.loads(line)
    missing = [k for k in ANSWER_KEYS if k not in answer]
    if missing:
        raise ValueError(f"llama_decode answer lacks {missing}: {line.strip()[:200]}")
    return answer


class LlamaDecode:
    """One running llama_decode process; generate() sends a request and waits for its answer."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1)

    def generate(self, ids: list[int], max_new_tokens: int) -> dict:
        self.proc.stdin.write(request_line(ids, max_new_tokens))
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama_decode exited with status {self.proc.wait()} (its stderr says why)")
        return parse_answer(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
