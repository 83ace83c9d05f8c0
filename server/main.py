"""`d3d serve` / `python -m sglang_d3d.server`: parse flags, check the backend, run uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn
from sglang_d3d.server.app import create_app
from sglang_d3d.server.args import parse_args
from sglang_d3d.server.backends import BackendUnavailable, check_backend
from sglang_d3d.server.http_layer import Server, uvicorn_config


def run_server(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        check_backend(cfg.backend)
    except BackendUnavailable as e:
        print(f"d3d serve: {e}", file=sys.stderr)
        return 2
    app = create_app(cfg, on_load_failure=lambda: _stop(server))
    # uvicorn first lets in-flight responses finish (up to the drain timeout), then the app's
    # lifespan shuts the engine down, aborting whatever is still running.
    config = uvicorn_config(
        app,
        cfg.max_header_bytes,
        cfg.connections,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        timeout_graceful_shutdown=max(1, int(cfg.drain_timeout)),
    )
    server = Server(config, on_shutdown=app.state.d3d.pools.close)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal after its graceful shutdown
        pass
    error = app.state.d3d.holder.error
    if error is not None:
        print(f"d3d serve: the model failed to load: {error}", file=sys.stderr)
        return 1
    return 0


def _stop(server: uvicorn.Server) -> None:
    """A server whose model cannot load should exit (and be restarted), not idle at 503."""
    server.should_exit = True
