import sys

from sglang_d3d.server.main import run_server

sys.exit(run_server(sys.argv[1:]))
