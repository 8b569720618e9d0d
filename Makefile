# Two commands do all setup on a fresh machine:
#   make serve   -> creates .venv, installs, pulls SmolLM2 if missing, serves it on :50051 (metrics :9400)
#   make test    -> creates .venv, installs (nginx + prometheus via apt if missing), runs the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test bench cuda-check cuda-check-files amx-check venv clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0  # the CPU build; must come before anything that depends on torch
	$(BIN)/pip install -q -e '.[server,dev]'
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/lmserve serve

test: $(STAMP)
	sh deploy/ci/install-test-deps.sh  # nginx and prometheus for the deployment tests (apt, once)
	sh deploy/ci/install-agent-clients.sh  # Claude Code and Codex CLI for the agent-client tests (npm, once)
	$(BIN)/pytest -q --durations=25

# The throughput benchmark; its report goes to reports/engine/<machine>.json (`lmserve bench --help` lists the others).
bench: $(STAMP)
	$(BIN)/lmserve bench engine

# On a CUDA host, offline, in at most ~5 minutes (two runs and two start-ups fit in 15 minutes of a lent GPU),
# with that host's own python3 and its CUDA build of torch (not $(STAMP)'s venv, whose torch is the CPU build):
# deploy/cuda-check/run.sh installs lmserve (editable) and what that python3 lacks from wheels carried in
# .cache/cuda-check/, writes the Llama-3.2-1B shape's random bfloat16 weights from the carried tokenizer-only
# GGUF, runs the CUDA tests (tests/*/test_*cuda*.py, and tests marked @pytest.mark.cuda anywhere), then
# `lmserve bench engine --device cuda` at c=1/8/32/64/128 in-process, through gRPC and HTTP, beside
# transformers' generate (where that host has transformers), with per-step statistics and the weight-stream
# bound. Its report goes to reports/engine/cuda-<gpu>-llama-3.2-1b.json, or with its logs under $OUT when set.
#   here, with the network, once:   make cuda-check-files         (~31 MB: wheels for CPython 3.11-3.13, tokenizer)
#   on the GPU host (the working tree and .cache/cuda-check copied there; allow it ~330 s): make cuda-check
#   a dry run on a CPU:             CUDA_CHECK_PYTHON=.venv/bin/python sh deploy/cuda-check/run.sh --device cpu \
#                                     --shape tiny --concurrency 1 2 --max-new-tokens 4
cuda-check:
	sh deploy/cuda-check/run.sh

cuda-check-files: $(STAMP)
	PIP=$(BIN)/pip sh deploy/cuda-check/wheels.sh .cache/cuda-check/wheels
	$(BIN)/python deploy/cuda-check/check.py --prepare --files .cache/cuda-check

# On a CPU whose OS grants AMX tiles: the tile paths' tests on the real instructions (elsewhere they run
# over a software tile unit), then the quantized kernels with tiles beside `-vnni` (tiles off), taking turns.
amx-check: $(STAMP)
	$(BIN)/python -c "from lmserve.model.linear import quant_matmul as QM; k = QM.default_kernel(); \
	assert k is not None and k.amx and not k.soft_tiles, 'no AMX tiles here: ' + (k.name if k else 'no native kernel')"
	$(BIN)/pytest -q tests/unit/test_kquant_matmul.py tests/unit/test_quant_matmul.py -k amx
	$(BIN)/lmserve bench kquant-kernels

clean:
	rm -rf $(VENV) .cache
