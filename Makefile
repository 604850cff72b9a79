# Everything sets itself up: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-mp install bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned, so nothing pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,hf]'
	# numba's cache, so that a layout's time limit is not spent compiling
	$(BIN)/python -m rhino.memory.warm
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rhino demo

# Every test: the single-process tests on two workers (one file per worker; each worker's torch threads take
# its share of the cores, tests/conftest.py), then the multi-process tests (local gloo ranks, torchrun, the
# elastic agent), also two files at a time: their ranks run one thread each and wait on each other and on
# process start-up, so one file at a time left a third of 2 cores idle (quiet machine: 386 s one at a time,
# 262 s two at a time).
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not multiprocess"
	$(BIN)/python -m pytest -n 2 --dist loadfile -m multiprocess

# For development: no processes started, nothing slow (a few minutes).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not multiprocess and not slow"

test-mp: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m multiprocess

bench: $(STAMP)
	$(BIN)/python benchmarks/step_time.py
	$(BIN)/python benchmarks/capture_gpt2xl.py

clean:
	rm -rf $(VENV) build src/*.egg-info
