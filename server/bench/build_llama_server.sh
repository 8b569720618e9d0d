#!/usr/bin/env sh
# Builds llama.cpp's `llama-server` as a benchmark peer (never a dependency of lmserve).
#
# The source is the llama.cpp tree vendored in the llama-cpp-python sdist on PyPI, so the build
# needs only the package index. The binary lands in .cache/peers/llama.cpp/bin/llama-server.
#
#   sh server/bench/build_llama_server.sh            # ~10 minutes on 2 cores
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 sh server/bench/build_llama_server.sh
#
# GGML_NATIVE is off: on AVX-512 + AMX Xeon VMs the native build dies with SIGILL. The ISA flags
# are set from what /proc/cpuinfo reports instead (AMX excepted), so the peer still gets its AVX-512
# kernels.
set -eu
root="$(cd "$(dirname "$0")/../.." && pwd)"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
dest="${LLAMA_SERVER_DIR:-$root/.cache/peers/llama.cpp}"
python="${PYTHON:-$root/.venv/bin/python}"
work="$dest/src"

if [ -x "$dest/bin/llama-server" ]; then
    echo "llama-server already built: $dest/bin/llama-server"
    exit 0
fi
mkdir -p "$work"
if [ ! -f "$work/llama_cpp_python-$version.tar.gz" ]; then
    "$python" -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==$version" -d "$work"
fi
[ -d "$work/llama_cpp_python-$version" ] || tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
tree="$work/llama_cpp_python-$version/vendor/llama.cpp"

flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { case " $flags " in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
isa="-DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)"
isa="$isa -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VNNI=$(has avx512_vnni)"
isa="$isa -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AVX512_VBMI=$(has avx512vbmi)"
# AMX stays off: a VM may list amx_* in cpuinfo without enabling the tile state (SIGILL at the first use).
# On a Xeon VM whose tile state lmserve's kernels are granted (2026-12-02), a build with AMX on still
# died with SIGILL as its thread pool started.
isa="$isa -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
echo "llama.cpp build flags: $isa"

# shellcheck disable=SC2086
cmake -S "$tree" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF $isa \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF > "$work/cmake.log"
cmake --build "$work/build" --target llama-server -j "$(nproc)" > "$work/build.log"
mkdir -p "$dest/bin"
cp "$work/build/bin/llama-server" "$dest/bin/llama-server"
echo "built $dest/bin/llama-server"
