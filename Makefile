# make demo   set up .venv and run the demo (RL trainer + 2 generators on this machine, CPU)
# make test   set up .venv and run the test suite (all but the chaos soak)
# make soak   the chaos soak: faults every few seconds while pushing (SOAK_SECONDS, default 150)
VENV ?= .venv
# test processes (pytest-xdist): most tests wait on their spawned peers (timeouts, frozen and killed
# processes), so 3 workers use 2 cores well and halve the suite's time; WORKERS=0 runs it in one process.
# --dist loadgroup: tests are spread one by one, except those of one xdist_group (the Ray tests), kept together
WORKERS ?= 3
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast soak bench doctor lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)

demo: setup
	$(PY) examples/rl_loop.py

test: setup
	$(PY) -m pytest -m "not soak" -n $(WORKERS) --dist loadgroup

test-fast: setup
	$(PY) -m pytest -m "not slow and not soak" -n $(WORKERS) --dist loadgroup

soak: setup
	$(PY) -m pytest -m soak tests/test_chaos_soak.py -q -s

bench: setup
	$(PY) bench/bench_transport.py
	$(PY) bench/bench_rl_sync.py

doctor: setup
	$(PY) -m transport doctor

lint: setup
	$(VENV)/bin/ruff check transport rl_sync tests examples bench
	$(VENV)/bin/mypy transport rl_sync
