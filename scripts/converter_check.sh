#!/usr/bin/env bash
# The converter check (tests/test_gguf_converter.py): llama.cpp's own convert_hf_to_gguf.py converts a
# small random model of each architecture to F16, its own llama-quantize makes Q8_0 and Q4_K_M of it, and
# specfree's reading of each file is compared with the source model, transformers and llama-server.
# The converter is the one the llama-cpp-python sdist vendors (the llama.cpp scripts/build_llama_cpp.sh
# builds), kept in specfree's cache beside the tools. Cached: a second run only runs the tests.
#   scripts/converter_check.sh [VERSION] [pytest arguments...]
set -euo pipefail
version="${1:-0.3.36}"
shift || true
here=$(cd "$(dirname "$0")" && pwd)
python="${PYTHON:-python3}"
convert="${XDG_CACHE_HOME:-$HOME/.cache}/specfree/llama.cpp/$version/convert"
if [ ! -f "$convert/convert_hf_to_gguf.py" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$python" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version" >&2
    tar xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
    src="$work/llama_cpp_python-$version/vendor/llama.cpp"
    # the converter, the modules it imports, and the gguf package it puts first on its path
    rm -rf "$convert.tmp" && mkdir -p "$convert.tmp"
    cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$convert.tmp/"
    rm -rf "$convert" && mv "$convert.tmp" "$convert"
fi
PYTHON="$python" bash "$here/build_llama_cpp.sh" "$version" >&2
if ! "$python" -c "import sentencepiece" 2>/dev/null; then  # the converter tries a sentencepiece vocabulary first
    echo "the converter needs sentencepiece: pip install 'specfree[converter-check]'" >&2; exit 1
fi
cd "$here/.."
"$python" -m pytest -q -m slow tests/test_gguf_converter.py "$@"
