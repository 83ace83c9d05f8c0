"""Run the real server in-process for tests: uvicorn on a thread, on a port the OS picks."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
from fastapi import FastAPI
from sglang_d3d.server.args import ServerConfig
from sglang_d3d.server.http_layer import Server, uvicorn_config

from sglang_d3d.config import EngineConfig, Mode, SpecConfig


def tiny_pair(tmp_dir: str | Path) -> tuple[str, str]:
    """(target_dir, drafter_dir): a tiny random pair, built in seconds."""
    from sglang_d3d.testing import make_tiny_pair

    return make_tiny_pair(tmp_dir)


def tiny_server_config(
    pair: tuple[str, str], mode: Mode = Mode.ASYNC, **engine: object
) -> ServerConfig:
    """A ServerConfig serving the tiny pair as model "tiny"; `engine` overrides EngineConfig."""
    base = EngineConfig(
        mode=mode,
        spec=SpecConfig(block_size=4),
        target_path=pair[0],
        drafter_path=pair[1],
        max_context=256,
        max_batch_size=8,
        max_queue=64,
        dtype="float64",  # no near-tie argmax flips between batch shapes: greedy stays exact
    )
    return ServerConfig(engine=replace(base, **engine), served_model_name="tiny", drain_timeout=5)


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 from a background thread."""

    def __init__(self, app: FastAPI, drain_timeout: int = 5) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        state = app.state.d3d
        config = uvicorn_config(app, state.cfg.max_header_bytes, state.cfg.connections,
                                log_level="warning",
                                timeout_graceful_shutdown=drain_timeout, lifespan="on")
        self.server = Server(config, on_shutdown=state.pools.close)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True, timeout: float = 120.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        if wait_ready:
            wait_healthy(self.url, deadline - time.monotonic())
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self if self._thread.is_alive() else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not become healthy in {timeout:.0f} s")
