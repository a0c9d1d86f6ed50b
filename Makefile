# The two commands of the README. Both do all set-up first (scripts/setup.sh is idempotent).
.PHONY: setup demo test lint

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m lmcache_histate.backends.demo

test: setup lint
	.venv/bin/python -m pytest

lint:
	.venv/bin/ruff check .
