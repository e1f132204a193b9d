#!/usr/bin/env bash
# Every measured number of the README from one run on one machine, one command after another (run
# nothing else meanwhile): the quick start's decode, the full bench ("Where it stands", the strategies'
# column), each SmolLM2 GGUF type against llama.cpp (the models table), and each file's peak RSS.
#   scripts/readme_run.sh OUT [SHARED]     # OUT: a folder (docs/bench/run_XX); SHARED: ../shared
# Needs llama-cpp-python (the `llama-cpp` extra) for llama.cpp's rows and the requantized files.
# Each step writes into OUT as it ends; OUT/log.txt says what ran, when, on which CPU.
set -euo pipefail
out="${1:?give the output folder, e.g. docs/bench/run_bb}"
shared="${2:-../shared}"
python="${PYTHON:-.venv/bin/python}"
prompts="$shared/bench/spec_bench_questions.jsonl"
files="${FILES:-$HOME/.cache/specfree/gguf-types}"   # requantized copies, kept for later runs
types="${TYPES:-Q4_0 Q8_0 Q4_K_M Q5_K_M Q6_K}"
mkdir -p "$out" "$files"
log="$out/log.txt"
say() { echo "$(date -u +%FT%TZ) $*" | tee -a "$log" >&2; }

say "cpu: $(lscpu | sed -n 's/^Model name: *//p') family $(lscpu | sed -n 's/^CPU family: *//p')" \
    "model $(lscpu | sed -n 's/^Model: *//p'), $(nproc) cores; commit $(git rev-parse --short HEAD)"

say "quick start"
"$python" -m specfree decode threads=2 output="$out/quick_start.json" \
    prompt="Rewrite in the past tense: The fox jumps over the dog." >"$out/quick_start.txt" 2>&1

say "bench: every strategy and outside system, SmolLM2 Q4_1 as shipped"
"$python" -m specfree bench bench.prompts="$prompts" bench.per_category=4 threads=2 compile=true \
    strategy=hybrid 'bench.strategies=[prompt_lookup, suffix, trie, recycling, sam, logit_spec, lookahead]' \
    'bench.baselines=[hf_generate, hf_prompt_lookup, llama_cpp, llama_cpp_lookup]' bench.out="$out/bench" \
    >"$out/bench.txt" 2>&1

peak() {  # the peak RSS of a 32-token compiled decode, its package already built: two runs
    for round in 1 2; do
        /usr/bin/time -f "%M" -o "$out/rss.tmp" "$python" -m specfree decode threads=2 compile=true \
            max_new_tokens=32 prompt="Name three colours." output="$out/rss_decode.json" "$@" >/dev/null 2>&1
        echo "$round $(cat "$out/rss.tmp") KiB $*" >>"$out/peak_rss.txt"
    done
}
say "peak RSS, Q4_1"
peak

for type in $types; do
    file="$files/smollm2.$type.gguf"
    [ -f "$file" ] || "$python" scripts/random_gguf.py smollm2 "$file" --type "$type" >>"$log" 2>&1
    say "bench $type"
    "$python" -m specfree bench bench.prompts="$prompts" bench.per_category=4 threads=2 compile=true \
        strategy=hybrid 'bench.baselines=[llama_cpp, llama_cpp_lookup]' bench.cost_curves=false \
        model=local model.path="$file" bench.out="$out/bench_$type" >"$out/bench_$type.txt" 2>&1
    say "peak RSS, $type"
    peak model=local model.path="$file"
done
rm -f "$out/rss.tmp" "$out/rss_decode.json"
say "done"
