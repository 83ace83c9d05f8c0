"""Grammar compiles in worker processes that can be stopped: a time limit, a cap on compiles in
flight, and an abandoned compile's worker killed.

xgrammar compiles in C++ and cannot be interrupted inside a thread: a slow schema kept a core
busy for minutes after its client had left, and threads still compiling held up the server's
exit. A process can be killed. Each worker (grammar_worker.py) builds a GrammarCompiler for the
engine's tokenizer once, then compiles one source at a time, checks that the vocabulary can
start an answer inside it, and sends back the compiled grammar as xgrammar's JSON, which the
server adopts (grammar.Grammars.adopt). Workers are plain subprocesses in the server's session
and process group, at the lowest CPU priority (grammar_worker.lower_priority says why the
session matters); they ignore a terminal's Ctrl-C, which is for the server, which stops them.

The pool is driven from one asyncio loop; it is not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

from sglang_d3d.config import GrammarSpec
from sglang_d3d.speculative.grammar import GrammarError
from sglang_d3d.speculative.grammar_worker import HEADER, frame

START_TIMEOUT = 300.0  # seconds a new worker may take to import xgrammar and read the vocabulary
WORKER = [sys.executable, "-m", "sglang_d3d.speculative.grammar_worker"]


class CompileTimeout(Exception):
    """The compile ran past the pool's time limit (its worker was killed)."""


class PoolBusy(Exception):
    """As many compiles are in flight as the pool has workers."""


class PoolClosed(Exception):
    """The pool was closed (the server is shutting down)."""


class GrammarPool:
    """Up to `workers` compiles at once, each stopped after `timeout` seconds. Workers start
    when first needed (their start-up does not count against the limit) and are reused."""

    def __init__(self, info_json: str, workers: int, timeout: float) -> None:
        if workers < 1 or timeout <= 0:
            raise ValueError("a grammar pool needs workers >= 1 and timeout > 0")
        self._info = frame(info_json)
        self.workers, self.timeout = workers, timeout
        self._idle: list[asyncio.subprocess.Process] = []
        self._all: set[asyncio.subprocess.Process] = set()  # every worker not killed yet
        self.in_flight = 0
        self.closed = False

    async def compile(self, spec: GrammarSpec) -> str:
        """The compiled grammar's JSON. Raises GrammarError (a bad source, or the compiler
        died on it), CompileTimeout, PoolBusy or PoolClosed. Cancelling it kills the worker."""
        if self.closed:
            raise PoolClosed
        if self.in_flight >= self.workers:
            raise PoolBusy
        self.in_flight += 1
        try:
            status, payload = await self._run(spec)
        finally:
            self.in_flight -= 1
        if status != "ok":
            raise GrammarError(payload, error_code(status))
        return payload

    async def _run(self, spec: GrammarSpec) -> tuple[str, str]:
        worker = None
        try:
            worker = self._take_idle() or await self._spawn()
            worker.stdin.write(frame(spec.kind, spec.source))
            async with asyncio.timeout(self.timeout):
                reply = await _read(worker), await _read(worker)
        except BaseException as e:
            if worker is not None:
                self._kill(worker)
            if self.closed:
                raise PoolClosed from e
            if isinstance(e, TimeoutError):
                raise CompileTimeout from None
            if isinstance(e, (EOFError, ConnectionError)):  # the compiler crashed on it
                raise GrammarError(f"the {spec.kind} crashed the grammar compiler") from None
            raise
        self._idle.append(worker)
        return reply

    def _take_idle(self) -> asyncio.subprocess.Process | None:
        """An idle worker still alive (one may have died meanwhile, killed by the OS)."""
        while self._idle:
            worker = self._idle.pop()
            if worker.returncode is None:
                return worker
            self._kill(worker)
        return None

    async def _spawn(self) -> asyncio.subprocess.Process:
        worker = await asyncio.create_subprocess_exec(
            *WORKER, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self._all.add(worker)
        try:
            worker.stdin.write(self._info)
            async with asyncio.timeout(START_TIMEOUT):
                ready = await _read(worker)
        except (EOFError, TimeoutError) as e:  # the server's fault, not the grammar's
            self._kill(worker)
            raise RuntimeError("a grammar compile worker did not start (its error is in the "
                               "server's log)") from e
        except BaseException:
            self._kill(worker)
            raise
        if ready != "ready":
            self._kill(worker)
            raise RuntimeError(f"a grammar compile worker said {ready[:80]!r}, not 'ready'")
        return worker

    def _kill(self, worker: asyncio.subprocess.Process) -> None:
        self._all.discard(worker)
        if worker in self._idle:
            self._idle.remove(worker)
        if worker.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.kill()  # reaped by asyncio's child watcher
        worker.stdin.close()

    def close(self) -> None:
        """Kill every worker; compiles in flight raise PoolClosed."""
        self.closed = True
        for worker in list(self._all):
            self._kill(worker)

    @property
    def num_workers(self) -> int:
        return len(self._all)


def error_code(status: str) -> str | None:
    """The code in a worker's "error CODE" status (None for a bare "error")."""
    _, _, code = status.partition(" ")
    return code or None


async def _read(worker: asyncio.subprocess.Process) -> str:
    """The worker's next frame; EOFError if it died."""
    try:
        head = await worker.stdout.readexactly(HEADER.size)
        data = await worker.stdout.readexactly(HEADER.unpack(head)[0])
    except asyncio.IncompleteReadError as e:
        raise EOFError("the grammar worker exited") from e
    return data.decode("utf-8", "surrogatepass")
