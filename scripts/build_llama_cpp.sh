#!/usr/bin/env bash
# llama.cpp's own tools (llama-server, llama-batched-bench, llama-bench, llama-quantize), built once from the llama.cpp
# that the llama-cpp-python sdist vendors, so that bench's and serve's peers are the same llama.cpp as
# bench's llama_cpp rows. Cached: a second run prints the folder at once.
#   scripts/build_llama_cpp.sh [VERSION]       ->  prints the folder holding the binaries
# Needs cmake and a C++ compiler; the sdist comes from the package registry (pip download).
set -euo pipefail
version="${1:-0.3.36}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/specfree/llama.cpp/$version"
bin="$cache/bin"
tools=(llama-server llama-batched-bench llama-bench llama-quantize)
if [ -x "$bin/llama-server" ] && [ -x "$bin/llama-batched-bench" ] && [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-quantize" ]; then
    echo "$bin"; exit 0
fi
python="${PYTHON:-python3}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version" >&2
tar xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
# the CPU as it is (GGML_NATIVE), no CURL (no network at run time), release build
# the binaries find their shared libraries beside them ($ORIGIN), wherever the folder is
# Without AMX tiles: built native on the Intel Xeon VM (family 6 model 167, AMX listed and granted),
# this llama.cpp's llama-server died at load with SIGILL on tilezero; it runs its AVX-512 VNNI code.
flags=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$work/build" --config Release -j "$(nproc)" --target "${tools[@]}" >&2
mkdir -p "$bin.tmp"
for tool in "${tools[@]}"; do cp "$work/build/bin/$tool" "$bin.tmp/"; done
cp "$work"/build/bin/*.so* "$bin.tmp/" 2>/dev/null || true
rm -rf "$bin" && mv "$bin.tmp" "$bin"
echo "$bin"
