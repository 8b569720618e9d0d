#!/usr/bin/env sh
# Regenerates the committed Python stubs beside proto/lmserve/v1/lmserve.proto.
# Run from anywhere; uses the python on PATH unless PYTHON is set.
set -eu
cd "$(dirname "$0")/.."
"${PYTHON:-python}" -m grpc_tools.protoc -I proto \
    --python_out=proto --grpc_python_out=proto --pyi_out=proto \
    proto/lmserve/v1/lmserve.proto
