# make demo   set up .venv and run the demo (two processes on this machine, CPU)
# make test   set up .venv and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast bench doctor lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)

demo: setup
	$(PY) examples/asyncio_put_get.py

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

bench: setup
	$(PY) bench/bench_transport.py

doctor: setup
	$(PY) -m transport doctor

lint: setup
	$(VENV)/bin/ruff check transport rl_sync tests examples bench
	$(VENV)/bin/mypy transport
