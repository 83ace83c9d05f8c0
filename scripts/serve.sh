#!/usr/bin/env bash
# `make serve`: `d3d serve` in the foreground, and one line once /health first answers 200.
# The first start converts the GGUF and builds the C++ kernels (a minute or more on two cores);
# later starts load in seconds. Extra arguments go to `d3d serve` (D3D_HOST and D3D_PORT set
# where it listens; `d3d serve --help` lists the rest).
set -euo pipefail
cd "$(dirname "$0")/.."
HOST=${D3D_HOST:-127.0.0.1}
PORT=${D3D_PORT:-8000}
URL="http://$HOST:$PORT"

# The server's own log, without the access lines of this script's polls of /health below.
.venv/bin/d3d serve --host "$HOST" --port "$PORT" "$@" \
  > >(grep --line-buffered -v '"GET /health HTTP/1.1" 503') 2>&1 &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true; wait "$pid" || true; exit 130' INT TERM
echo "make serve: loading the models; the server answers at $URL once this prints 'ready'"

# Poll /health while the server runs; say once when it is ready.
.venv/bin/python - "$URL" "$pid" <<'PY' || true
import os, sys, time, urllib.request

url, pid, t0 = sys.argv[1], int(sys.argv[2]), time.monotonic()
while True:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)  # the server stopped; its own log says why
    try:
        if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
            print(f"make serve: ready at {url} after {time.monotonic() - t0:.0f} s "
                  "(Ctrl-C stops it)", flush=True)
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
PY
wait "$pid"
