"""scripts/setup.sh's PyTorch step on a machine without a GPU: the CPU build from PyTorch's CPU
index where it answers, plain pip otherwise, saying which (pip itself stubbed: nothing is
installed)."""

import http.server
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _install_torch(index: str) -> str:
    """Run setup.sh's own install_torch_for_cpu against `index`, with pip echoed."""
    script = (
        "set -euo pipefail\n"
        f"VENV={Path(sys.executable).parent.parent}\n"
        'PIP="echo pip"\n'
        "eval \"$(sed -n '/^TORCH=/,/^}/p' scripts/setup.sh)\"\n"
        f"CPU_INDEX={index}\n"
        "install_torch_for_cpu\n"
    )
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", "scripts/setup.sh"], cwd=ROOT).returncode == 0


def test_the_cpu_index_is_used_where_it_answers(tmp_path):
    (tmp_path / "torch").mkdir()
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_address[1]}"
        out = _install_torch(index)
    finally:
        server.shutdown()
    assert f"setup: installing the CPU build of PyTorch from {index}" in out
    assert f"pip install --index-url {index} torch==" in out
    assert "setup: torch " in out  # and which build it ended with


def test_an_unreachable_index_falls_back_to_pip_and_says_so():
    out = _install_torch("http://127.0.0.1:9/whl/cpu")  # the discard port: refused at once
    assert "cannot be reached from here" in out and "CUDA build, several GB" in out
    assert "pip install torch==" in out and "--index-url" not in out.split("\n")[1]
    assert "setup: torch " in out
