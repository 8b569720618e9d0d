#!/bin/sh
# make cuda-check: on a CUDA host that is offline, with its own python3 (a CUDA build of torch), in at most
# ~5 minutes: install lmserve (editable) and what that python3 lacks from the wheels carried in
# $CUDA_CHECK_FILES (default .cache/cuda-check, filled by `make cuda-check-files` where the network is),
# then check.py: the 1B shape's random weights, the CUDA tests, `lmserve bench engine` (see check.py).
# Arguments go to check.py (a dry run on a CPU: --device cpu --shape tiny --concurrency 1 2 --max-new-tokens 4).
# Everything to bring back goes under $OUT when it is set.
set -u
cd "$(dirname "$0")/../.." || exit 2
CUDA_CHECK_T0=${CUDA_CHECK_T0:-$(date +%s)}
export CUDA_CHECK_T0
PY=${CUDA_CHECK_PYTHON:-python3}
FILES=${CUDA_CHECK_FILES:-.cache/cuda-check}
if [ ! -d "$FILES/wheels" ]; then
    echo "cuda-check: $FILES/wheels is missing: run \`make cuda-check-files\` where the network is, and carry $FILES" >&2
    exit 2
fi
# installed already (a dry run in the project's own environment): nothing to do
if ! $PY -c "import lmserve.server.app, gguf, starlette, uvicorn, llguidance, grpc_reflection, pytest_asyncio" 2>/dev/null; then
    echo "cuda-check: installing lmserve and its missing needs from $FILES/wheels"
    pip="$PY -m pip install -q --no-index --no-cache-dir --disable-pip-version-check --find-links $FILES/wheels"
    # the editable build runs without isolation: pyproject's build backend must be there first
    $pip 'setuptools>=77' wheel || exit 3
    # what this python3 has and satisfies lmserve stays (torch above all); the carried wheels fill in the rest
    $pip --no-build-isolation -e '.[server]' pytest pytest-asyncio pytest-timeout || exit 3
fi
exec $PY deploy/cuda-check/check.py --files "$FILES" "$@"
