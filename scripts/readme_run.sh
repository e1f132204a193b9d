#!/usr/bin/env bash
# Every measured number of README.md (README.md#where-it-stands names the run) from one run on one
# machine, one command after another (run nothing else meanwhile): the quick start's decode, each
# SmolLM2 GGUF type at both precisions beside llama.cpp's own server (the models table) with its peak
# RSS, the full bench ("Where it stands", the strategies' column), and several requests decoded
# together. Every step but the exact benches runs the default precision (int8 on these files).
#   scripts/readme_run.sh OUT [SHARED]     # OUT: a folder (docs/bench/run_XX); SHARED: ../shared
#   STEPS="types batch" scripts/readme_run.sh OUT   # only some steps (quick, types, bench, batch)
# Needs llama-cpp-python (the `llama-cpp` extra: llama_cpp rows, requantized files) and llama-server
# (scripts/build_llama_cpp.sh). Each step writes into OUT as it ends; OUT/log.txt says what ran, when,
# on which CPU and commit.
set -euo pipefail
out="${1:?give the output folder, e.g. docs/bench/run_bb}"
shared="${2:-../shared}"
python="${PYTHON:-.venv/bin/python}"
prompts="$shared/bench/spec_bench_questions.jsonl"
files="${FILES:-$HOME/.cache/specfree/gguf-types}"   # requantized copies, kept for later runs
types="${TYPES:-Q4_1 Q4_0 Q8_0 Q4_K_M Q5_K_M Q6_K}"
steps="${STEPS:-quick types bench batch}"
servers='[llama_server, {name: llama_server, spec_type: ngram-mod}]'
mkdir -p "$out" "$files"
log="$out/log.txt"
say() { echo "$(date -u +%FT%TZ) $*" | tee -a "$log" >&2; }
wants() { [[ " $steps " == *" $1 "* ]]; }

say "cpu: $(lscpu | sed -n 's/^Model name: *//p') family $(lscpu | sed -n 's/^CPU family: *//p')" \
    "model $(lscpu | sed -n 's/^Model: *//p'), $(nproc) cores; commit $(git rev-parse --short HEAD); steps: $steps"

if wants quick; then
    say "quick start"
    "$python" -m specfree decode threads=2 output="$out/quick_start.json" \
        prompt="Rewrite in the past tense: The fox jumps over the dog." >"$out/quick_start.txt" 2>&1
fi

peak() {  # the peak RSS of a 32-token compiled decode, its package already built: two runs
    for round in 1 2; do
        /usr/bin/time -f "%M" -o "$out/rss.tmp" "$python" -m specfree decode threads=2 compile=true \
            max_new_tokens=32 prompt="Name three colours." output="$out/rss_decode.json" "$@" >/dev/null 2>&1
        echo "$round $(cat "$out/rss.tmp") KiB $*" >>"$out/peak_rss.txt"
    done
}

if wants types; then
    for type in $types; do
        if [ "$type" = Q4_1 ]; then
            model=(model=smollm2)  # the file as shipped
        else
            file="$files/smollm2.$type.gguf"
            [ -f "$file" ] || "$python" scripts/random_gguf.py smollm2 "$file" --type "$type" >"$out/quantize.txt" 2>&1
            model=(model=local model.path="$file")
        fi
        say "bench $type, default precision (int8): the hybrid and the compiled loop beside llama-server, plain and ngram-mod"
        "$python" -m specfree bench bench.prompts="$prompts" bench.per_category=4 threads=2 compile=true \
            strategy=hybrid "bench.baselines=$servers" bench.cost_curves=false "${model[@]}" \
            bench.out="$out/bench_$type" >"$out/bench_$type.txt" 2>&1
        say "bench $type, precision=exact: the hybrid and the compiled loop"
        "$python" -m specfree bench bench.prompts="$prompts" bench.per_category=4 threads=2 compile=true \
            precision=exact strategy=hybrid 'bench.baselines=[]' bench.cost_curves=false "${model[@]}" \
            bench.out="$out/bench_${type}_exact" >"$out/bench_${type}_exact.txt" 2>&1
        # the file's size beside its numbers (the bench records the path, which a later checkout may lack)
        "$python" -c 'import json, os, sys; s = json.load(open(sys.argv[1]))["systems"]
print(sys.argv[2], next(os.path.getsize(x["params"]["gguf"]) for x in s if x["strategy"] == "llama_server"))' \
            "$out/bench_$type/bench.json" "$type" >>"$out/sizes.txt"
        say "peak RSS, $type"
        peak "${model[@]}"
    done
fi

if wants bench; then
    say "bench: every strategy and outside system, SmolLM2 Q4_1 as shipped"
    "$python" -m specfree bench bench.prompts="$prompts" bench.per_category=4 threads=2 compile=true \
        strategy=hybrid 'bench.strategies=[prompt_lookup, suffix, trie, recycling, sam, logit_spec, lookahead]' \
        'bench.baselines=[hf_generate, hf_prompt_lookup, llama_cpp, llama_cpp_lookup]' bench.out="$out/bench" \
        >"$out/bench.txt" 2>&1
fi

if wants batch; then
    say "bench, SmolLM2 Q4_1: the hybrid and suffix beside llama-server, then 4 requests at a time"
    "$python" -m specfree bench bench.prompts="$prompts" bench.per_category=4 threads=2 compile=true \
        strategy=hybrid 'bench.strategies=[suffix]' "bench.baselines=$servers" \
        bench.concurrency=4 bench.out="$out/bench_batch" >"$out/bench_batch.txt" 2>&1
fi
rm -f "$out/rss.tmp" "$out/rss_decode.json"
say "done"
