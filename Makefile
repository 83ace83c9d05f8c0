# The two commands the README gives. Both do all set-up on a fresh machine into .venv/.
.PHONY: serve test lint

serve:
	bash scripts/setup.sh
	.venv/bin/d3d serve

test:
	bash scripts/setup.sh dev
	.venv/bin/python -m pytest -q -p no:cacheprovider tests

lint:
	.venv/bin/ruff check sglang_d3d server benchmarks tests
