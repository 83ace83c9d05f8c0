"""A grammar compile worker process (`python -m sglang_d3d.speculative.grammar_worker`), run by
grammar_pool.GrammarPool.

On stdin: the tokenizer (xgrammar's TokenizerInfo JSON), then a kind and a source per compile.
On stdout: "ready" once its compiler is built, then per compile "ok" and the compiled grammar's
JSON, or "error" (or "error CODE", an error code for the client) and a message. Each is one frame: its length, then its UTF-8 text (`frame`,
`read`). It exits when stdin closes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import sys
from typing import BinaryIO

HEADER = struct.Struct(">Q")  # a message's length in bytes
NICENESS = 19  # the lowest CPU priority: a compile takes only the time decoding leaves
# Larger compiled grammars are refused: the server deserializes each one it adopts, about
# 45 ms per MB on one core (13.5 MB: 0.6 s), and keeps 64 MiB of them.
MAX_COMPILED_BYTES = 16 << 20
TOO_LARGE = "grammar_too_large"  # the error code of that refusal (as for sources over limits)


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
        return _error(e.code), str(e)
    out = compiled.serialize_json()
    if len(out) > MAX_COMPILED_BYTES:
        return _error(TOO_LARGE), (f"the compiled {kind} takes {len(out) >> 20} MiB, over this "
                                   f"server's limit of {MAX_COMPILED_BYTES >> 20} MiB; simplify it")
    return "ok", out


def _error(code: str | None) -> str:
    """An error's status frame: "error", or "error CODE" (grammar_pool.error_code reads it)."""
    return "error" if code is None else f"error {code}"


def lower_priority() -> None:
    """This process at nice 19, the lowest priority a process may take without privileges.
    It stays in the server's session (grammar_pool.py starts it so): where Linux groups CPU
    time by session (kernel.sched_autogroup_enabled), a nice value weighs only inside the
    session, and a worker in a session of its own took a full session's share whatever its
    nice value (one compile slowed every chat of a 2-core engine about 45x). Not SCHED_IDLE:
    a server decoding without pause would then never compile at all."""
    with contextlib.suppress(OSError):
        os.nice(NICENESS - os.nice(0))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the server stops us
    lower_priority()
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
