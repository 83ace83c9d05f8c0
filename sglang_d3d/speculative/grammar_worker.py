"""A grammar compile worker process (`python -m sglang_d3d.speculative.grammar_worker`), run by
grammar_pool.GrammarPool.

On stdin: the tokenizer (xgrammar's TokenizerInfo JSON), then a kind and a source per compile.
On stdout: "ready" once its compiler is built, then per compile "ok" and the compiled grammar's
JSON, or "error" and a message. Each is one frame: its length, then its UTF-8 text (`frame`,
`read`). It exits when stdin closes.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
from typing import BinaryIO

HEADER = struct.Struct(">Q")  # a message's length in bytes
NICENESS = 10  # below the server's CPU priority: a compile takes the cores decoding leaves
# Larger compiled grammars are refused: the server deserializes each one it adopts, about
# 45 ms per MB on one core (13.5 MB: 0.6 s), and keeps 64 MiB of them.
MAX_COMPILED_BYTES = 16 << 20


def frame(*texts: str) -> bytes:
    out = b""
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")  # a source may hold a lone surrogate
        out += HEADER.pack(len(data)) + data
    return out


def read(inp: BinaryIO) -> str | None:
    """The next frame's text, or None at end of input."""
    head = inp.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    return inp.read(HEADER.unpack(head)[0]).decode("utf-8", "surrogatepass")


def write(out: BinaryIO, *texts: str) -> None:
    out.write(frame(*texts))
    out.flush()


def compile_job(compiler, info, kind: str, source: str) -> tuple[str, str]:
    from sglang_d3d.config import GrammarSpec
    from sglang_d3d.speculative.grammar import Constraint, GrammarError, _xgrammar, compile_source

    spec = GrammarSpec(kind, source)
    try:
        compiled = compile_source(compiler, spec)
        # The engine's own check: some token of the vocabulary must start the answer.
        Constraint(_xgrammar().GrammarMatcher(compiled), info.vocab_size).chain([])
    except GrammarError as e:
        return "error", str(e)
    out = compiled.serialize_json()
    if len(out) > MAX_COMPILED_BYTES:
        return "error", (f"the compiled {kind} takes {len(out) >> 20} MiB, over this server's "
                         f"limit of {MAX_COMPILED_BYTES >> 20} MiB; simplify it")
    return "ok", out


def main() -> None:
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    from sglang_d3d.speculative.grammar import _xgrammar

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but messages on the pipe
    info_json = read(inp)
    if info_json is None:
        return
    xgr = _xgrammar()
    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write(out, "ready")
    while (kind := read(inp)) is not None and (source := read(inp)) is not None:
        write(out, *compile_job(compiler, info, kind, source))


if __name__ == "__main__":
    main()
