#!/bin/sh
# Fills $1 (default .cache/cuda-check/wheels) with the wheels of wheels.txt for CPython 3.11, 3.12 and 3.13
# on manylinux x86-64 (which python3 a CUDA host has is not known ahead; 3.12 was seen), for a host that is
# offline. Pure-Python wheels come once; binary ones (grpcio, httptools, llguidance, protobuf) once per version.
set -eu
here=$(dirname "$0")
dest=${1:-.cache/cuda-check/wheels}
pip=${PIP:-pip}
mkdir -p "$dest"
reqs=$(grep -v '^#' "$here/wheels.txt" | grep .)
for py in 3.11 3.12 3.13; do
    # shellcheck disable=SC2086  # one argument per requirement
    $pip download -q --no-deps --only-binary=:all: --dest "$dest" --implementation cp --python-version "$py" \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 $reqs
done
du -sh "$dest"
