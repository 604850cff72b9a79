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

# Every test: the single-process tests on two workers (one file per worker), then the multi-process tests
# (local gloo ranks, torchrun, the elastic agent) one at a time, since they use every core themselves.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not multiprocess"
	$(BIN)/python -m pytest -m multiprocess

# For development: no processes started, nothing slow (a few minutes).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not multiprocess and not slow"

test-mp: $(STAMP)
	$(BIN)/python -m pytest -m multiprocess

bench: $(STAMP)
	$(BIN)/python benchmarks/step_time.py
	$(BIN)/python benchmarks/capture_gpt2xl.py

clean:
	rm -rf $(VENV) build src/*.egg-info
