# Two commands do all setup on a fresh machine:
#   make serve   -> creates .venv, installs, pulls SmolLM2 if missing, serves it on :50051 (metrics :9400)
#   make test    -> creates .venv, installs (nginx + prometheus via apt if missing), runs the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test bench cuda-check amx-check venv clean

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
	$(BIN)/pytest -q --durations=25

# The throughput benchmark; its report goes to reports/engine/<machine>.json (`lmserve bench --help` lists the others).
bench: $(STAMP)
	$(BIN)/lmserve bench engine

# On a CUDA host (a CUDA build of torch in the environment): the GPU tests, then the benchmark in bfloat16.
cuda-check: $(STAMP)
	$(BIN)/pytest -q -s tests/unit/test_cuda_model.py tests/integration/test_cuda_metrics.py
	$(BIN)/lmserve bench engine --device cuda

# On a CPU whose OS grants AMX tiles: the tile paths' tests on the real instructions (elsewhere they run
# over a software tile unit), then the quantized kernels with tiles beside `-vnni` (tiles off), taking turns.
amx-check: $(STAMP)
	$(BIN)/python -c "from lmserve.model.linear import quant_matmul as QM; k = QM.default_kernel(); \
	assert k is not None and k.amx and not k.soft_tiles, 'no AMX tiles here: ' + (k.name if k else 'no native kernel')"
	$(BIN)/pytest -q tests/unit/test_kquant_matmul.py tests/unit/test_quant_matmul.py -k amx
	$(BIN)/lmserve bench kquant-kernels

clean:
	rm -rf $(VENV) .cache
