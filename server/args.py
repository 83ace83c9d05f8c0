"""`d3d serve` options: a frozen ServerConfig on top of EngineConfig, and the argparse that fills it.

The flags mirror EngineConfig/SpecConfig one to one, and their defaults are read from those
dataclasses so that the engine stays the single source of truth.
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field
from pathlib import Path

from sglang_d3d.config import BranchPolicy, EngineConfig, Mode, SpecConfig
from sglang_d3d.models.loading import DEFAULT_TARGET_NAME


class Backend(str, enum.Enum):
    """Which engine serves the requests."""

    EMBEDDED = "embedded"  # sglang_d3d.engine: our own engine loop (CPU or one GPU)
    SGLANG = "sglang"  # sglang_d3d.sglang_worker: the D3D worker inside SGLang (CUDA only)


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    backend: Backend = Backend.EMBEDDED
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: str | None = None  # None: the target folder's name
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish on shutdown
    retry_after: int = 1  # seconds, sent with 503 (queue full, still loading)
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")

    @property
    def model_name(self) -> str:
        """The id clients put in `model` and that /v1/models lists."""
        if self.served_model_name:
            return self.served_model_name
        target = self.engine.target_path
        if target is None or target == "default":
            return DEFAULT_TARGET_NAME
        return Path(target).resolve().name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="d3d serve", description="OpenAI-compatible server for D3D speculative decoding."
    )
    _add_server_args(p)
    _add_model_args(p)
    _add_spec_args(p)
    _add_limit_args(p)
    return p


def _add_enum(g, flag: str, kind: type[enum.Enum], default: enum.Enum) -> None:
    g.add_argument(flag, type=kind, choices=list(kind), default=default, metavar="|".join(kind))


def _add_server_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--served-model-name", default=None, help="default: the target's folder name")
    _add_enum(g, "--backend", Backend, d.backend)
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout)
    g.add_argument("--log-level", default=d.log_level)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("models and devices")
    g.add_argument(
        "--target", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)"
    )
    g.add_argument("--drafter", default=None, help="D3D drafter folder (default: the shipped one)")
    _add_enum(g, "--mode", Mode, d.mode)
    g.add_argument("--device", default=d.device)
    g.add_argument("--draft-device", default=None, help="default: same as --device")
    g.add_argument("--dtype", default=d.dtype)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    d = SpecConfig()
    g = p.add_argument_group("speculation")
    g.add_argument("--block-size", type=int, default=d.block_size)
    _add_enum(g, "--branch-policy", BranchPolicy, d.branch_policy)
    g.add_argument("--branch-budget", type=int, default=d.branch_budget)
    g.add_argument("--guesses-per-position", type=int, default=d.guesses_per_position)
    g.add_argument("--verify-token-budget", type=int, default=EngineConfig().verify_token_budget)
    g.add_argument("--min-block-size", type=int, default=EngineConfig().min_block_size)


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("batching and limits")
    g.add_argument(
        "--max-concurrency", type=int, default=d.max_batch_size, help="running requests per cycle"
    )
    g.add_argument(
        "--max-queue", type=int, default=d.max_queue, help="waiting requests; 503 past it"
    )
    g.add_argument("--max-context", type=int, default=d.max_context, help="prompt + output tokens")


def config_from_args(ns: argparse.Namespace) -> ServerConfig:
    spec = SpecConfig(
        block_size=ns.block_size,
        branch_policy=ns.branch_policy,
        branch_budget=ns.branch_budget,
        guesses_per_position=ns.guesses_per_position,
    )
    engine = EngineConfig(
        mode=ns.mode,
        spec=spec,
        target_path=ns.target,
        drafter_path=ns.drafter,
        device=ns.device,
        draft_device=ns.draft_device,
        dtype=ns.dtype,
        max_batch_size=ns.max_concurrency,
        max_context=ns.max_context,
        max_queue=ns.max_queue,
        verify_token_budget=ns.verify_token_budget,
        min_block_size=ns.min_block_size,
    )
    return ServerConfig(
        engine=engine,
        backend=ns.backend,
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name,
        drain_timeout=ns.drain_timeout,
        log_level=ns.log_level,
    )


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return config_from_args(ns)
    except ValueError as e:  # a config check failed: report it like any other bad flag
        parser.error(str(e))
        raise  # unreachable: parser.error exits
