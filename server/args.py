"""`d3d serve` options: a frozen ServerConfig on top of EngineConfig, and the argparse that fills it.

The flags mirror EngineConfig/SpecConfig one to one, and their defaults are read from those
dataclasses so that the engine stays the single source of truth.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from dataclasses import dataclass, field
from pathlib import Path

from sglang_d3d.server.auth import ENV_VAR, keys_from_env
from sglang_d3d.server.http_layer import ConnectionLimits
from sglang_d3d.server.limits import GrammarLimits

from sglang_d3d.cli_args import add_engine_args, engine_config
from sglang_d3d.config import EngineConfig
from sglang_d3d.models.loading import DEFAULT_TARGET_NAME

REQUEST_TOKENS_PER_CONTEXT = 32  # default --max-request-tokens: 65,536 at --max-context 2048
FEW_CORES = 4  # up to this many cores, one grammar compile at a time by default


def default_grammar_workers(cores: int | None = None) -> int:
    """Compiles at once by default: 1 on a machine of up to FEW_CORES cores (a compile takes a
    whole core, at the lowest priority, but a second one would leave decoding little), else 2."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 1 if (cores or 1) <= FEW_CORES else 2


class Backend(str, enum.Enum):
    """Which engine serves the requests."""

    EMBEDDED = "embedded"  # sglang_d3d.engine: our own engine loop (CPU or one GPU)
    SGLANG = "sglang"  # sglang_d3d.sglang_worker: the D3D worker inside SGLang (CUDA only)


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    backend: Backend = Backend.EMBEDDED
    host: str = "127.0.0.1"  # this machine only; the Helm chart and images bind 0.0.0.0
    port: int = 8000
    served_model_name: str | None = None  # None: the target folder's name
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish on shutdown
    retry_after: int = 1  # seconds, sent with 503 (queue full, still loading)
    log_level: str = "info"
    api_keys: tuple[str, ...] = ()  # empty: /v1/* is open
    metrics_need_key: bool = False  # /metrics asks for an API key too
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    body_timeout: float = 30.0  # seconds to receive a request body; slower uploads get 408
    max_header_bytes: int = 64 * 1024  # request headers (names and values) beyond get 431
    # n (or best_of) x max_tokens, the tokens one request may generate; None: 32 x max_context
    max_request_tokens: int | None = None
    grammar_timeout: float = 10.0  # seconds one grammar compile may take (then 400)
    # compile processes: compiles in flight beyond get 503 (default_grammar_workers)
    grammar_workers: int = field(default_factory=default_grammar_workers)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)  # header and idle
    # timeouts, the cap on open connections
    limits: GrammarLimits = field(default_factory=GrammarLimits)  # sources, JSON nesting

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if min(self.body_timeout, self.grammar_timeout) <= 0:
            raise ValueError("--body-timeout and --grammar-timeout must be > 0")
        if min(self.max_header_bytes, self.grammar_workers, self.request_token_budget) < 1:
            raise ValueError("--max-header-bytes, --grammar-workers and --max-request-tokens "
                             "must be >= 1")
        if self.backend is Backend.SGLANG and self.engine.draft_weights == "int8":
            raise ValueError("--draft-weights int8 is for the embedded backend on CPU: "
                             "SGLang's worker drafts on the GPU")
        if self.backend is Backend.SGLANG and (self.engine.tree_nodes or self.engine.lookup_tokens):
            raise ValueError("--tree-nodes and --lookup-tokens are for the embedded backend: "
                             "SGLang's worker verifies chains")
        if self.metrics_need_key and not self.api_keys:
            raise ValueError("--metrics-need-key needs an API key (--api-key or D3D_API_KEY)")

    @property
    def request_token_budget(self) -> int:
        """The most tokens one request may ask to generate (n or best_of x max_tokens)."""
        if self.max_request_tokens is not None:
            return self.max_request_tokens
        return REQUEST_TOKENS_PER_CONTEXT * self.engine.max_context

    @property
    def model_name(self) -> str:
        """The id clients put in `model` and that /v1/models lists."""
        if self.served_model_name:
            return self.served_model_name
        target = self.engine.target_path
        if target is None or target == "default" or is_default_target_folder(target):
            return DEFAULT_TARGET_NAME  # one name however the default target is named
        return Path(target).resolve().name


def is_default_target_folder(path: str) -> bool:
    """Whether `path` is the folder the default target is converted into (models/loading.py)."""
    from sglang_d3d.models.loading import cache_dir

    return Path(path).resolve() == (cache_dir() / "smollm2-135m-instruct").resolve()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="d3d serve", description="OpenAI-compatible server for D3D speculative decoding."
    )
    _add_server_args(p)
    # The same engine flags as `d3d generate` and `d3d bench`; a server adapts its speculation
    # to the load by default, so that throughput never falls below target-only decoding.
    add_engine_args(p, adaptive=True)
    return p


def _add_server_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="address to listen on")
    g.add_argument("--port", type=int, default=d.port, help="port to listen on")
    g.add_argument("--served-model-name", default=None, help="default: the target's folder name")
    g.add_argument("--backend", type=Backend, choices=list(Backend), default=d.backend,
                   metavar="|".join(Backend),
                   help="embedded: this package's engine; sglang: SGLang's scheduler with the "
                   "D3D worker (docs/sglang.md)")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help="seconds in-flight responses may finish after SIGTERM")
    g.add_argument("--log-level", default=d.log_level,
                   help="debug, info, warning or error")
    g.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"require `Authorization: Bearer KEY` on /v1/* (repeatable; also the "
                   f"comma-separated environment variable {ENV_VAR})")
    g.add_argument("--metrics-need-key", action="store_true",
                   help="/metrics requires an API key too (default: open, like /health)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="larger request bodies are refused with 413 (default: 8 MiB)")
    _add_limit_args(p, d)


def _add_limit_args(p: argparse.ArgumentParser, d: ServerConfig) -> None:
    g = p.add_argument_group("limits (docs/api.md, Limits)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds to receive a request body; slower uploads get 408 and the "
                   "connection is closed (default: %(default)s)")
    g.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes,
                   help="larger request headers are refused with 431 (default: 64 KiB)")
    c = d.connections
    g.add_argument("--header-timeout", type=float, default=c.header_timeout,
                   help="seconds for a request's line and headers to arrive, from the "
                   "connection's start or the next request's first byte; then 408 (or, if "
                   "nothing came, no answer) and the connection is closed (default: %(default)s)")
    g.add_argument("--keep-alive-timeout", type=float, default=c.keep_alive_timeout,
                   help="seconds an idle kept-alive connection stays open (default: %(default)s)")
    g.add_argument("--max-connections", type=int, default=c.max_connections,
                   help="open connections; more are answered 503 and closed (default: "
                   "%(default)s)")
    g.add_argument("--max-request-tokens", type=int, default=None,
                   help="most tokens one request may generate, n (or best_of) x max_tokens; "
                   f"more is a 400 (default: {REQUEST_TOKENS_PER_CONTEXT} x --max-context)")
    g.add_argument("--grammar-timeout", type=float, default=d.grammar_timeout,
                   help="seconds one grammar compile may take before its request gets a 400 "
                   "(default: %(default)s)")
    g.add_argument("--grammar-workers", type=int, default=None,
                   help="grammar compile processes, run at the lowest CPU priority; more "
                   f"compiles at once get 503 (default: 1 on up to {FEW_CORES} cores, else 2)")
    g.add_argument("--max-grammar-bytes", type=int, default=d.limits.max_bytes,
                   help="largest regex, EBNF or JSON schema (default: 64 KiB)")
    g.add_argument("--max-schema-enum", type=int, default=d.limits.max_enum,
                   help="enum and const values in one schema (default: %(default)s)")
    g.add_argument("--max-schema-properties", type=int, default=d.limits.max_properties,
                   help="object properties in one schema (default: %(default)s)")
    g.add_argument("--max-json-depth", type=int, default=d.limits.max_depth,
                   help="deepest nesting of a request body, a schema, or a regex's or EBNF's "
                   "brackets (default: %(default)s)")


def config_from_args(ns: argparse.Namespace) -> ServerConfig:
    engine = engine_config(ns)
    if ns.backend is Backend.SGLANG:  # its worker verifies chains
        engine = dataclasses.replace(
            engine, tree_nodes=engine.tree_nodes if ns.tree_nodes is not None else 0,
            lookup_tokens=engine.lookup_tokens if ns.lookup_tokens is not None else 0)
    return ServerConfig(
        engine=engine,
        backend=ns.backend,
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name,
        drain_timeout=ns.drain_timeout,
        log_level=ns.log_level,
        api_keys=tuple(dict.fromkeys([*ns.api_key, *keys_from_env()])),
        metrics_need_key=ns.metrics_need_key,
        max_body_bytes=ns.max_body_bytes,
        body_timeout=ns.body_timeout,
        max_header_bytes=ns.max_header_bytes,
        max_request_tokens=ns.max_request_tokens,
        grammar_timeout=ns.grammar_timeout,
        grammar_workers=(ns.grammar_workers if ns.grammar_workers is not None
                         else default_grammar_workers()),
        connections=ConnectionLimits(ns.header_timeout, ns.keep_alive_timeout,
                                     ns.max_connections),
        limits=GrammarLimits(ns.max_grammar_bytes, ns.max_json_depth, ns.max_schema_enum,
                             ns.max_schema_properties),
    )


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return config_from_args(ns)
    except ValueError as e:  # a config check failed: report it like any other bad flag
        parser.error(str(e))
        raise  # unreachable: parser.error exits
