# The two commands the README gives. Both do all set-up on a fresh machine into .venv/.
.PHONY: serve test lint bench-peers

serve:
	bash scripts/setup.sh
	bash scripts/serve.sh

test:
	bash scripts/setup.sh dev
	.venv/bin/python -m pytest -q -p no:cacheprovider tests

# ruff for Python; scripts/lint_tree.py for every tracked text file (JSON, YAML, shell, Markdown):
# no machine paths, no words about how the project was made, JSON that parses.
lint:
	.venv/bin/ruff check sglang_d3d server benchmarks tests scripts
	.venv/bin/python scripts/lint_tree.py

# Side-by-side with llama.cpp and Hugging Face (benchmarks/bench_peers.py). llama.cpp builds
# from source for this CPU (about 10 minutes on two cores; benchmarks/llama_cmake_args.py says
# with which instruction sets); it is a benchmark extra only. scripts/build_llama_decode.sh then
# links llama.cpp's own C++ decode loop (the llama-cpp row) to that library, into .llama/.
bench-peers:
	bash scripts/setup.sh dev
	CMAKE_ARGS="$$(.venv/bin/python benchmarks/llama_cmake_args.py)" .venv/bin/python -m pip install -q -e '.[peers]'
	bash scripts/build_llama_decode.sh
	.venv/bin/python benchmarks/bench_peers.py --out benchmarks/results/peers.json
	.venv/bin/python benchmarks/plot_peers.py benchmarks/results/peers.json benchmarks/results/peers.png
