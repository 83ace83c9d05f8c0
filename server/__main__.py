import sys

from server.main import run_server

sys.exit(run_server(sys.argv[1:]))
