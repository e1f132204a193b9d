#!/usr/bin/env bash
# The checks to run first on a machine with an NVIDIA GPU (specfree and its test extras installed):
#   bash scripts/gpu_check.sh tests OUT [DEVICE]                  lossless property tests on the GPU
#   bash scripts/gpu_check.sh bench OUT [MODEL_PATH] [PROMPTS] [COMPILE] [OVERRIDE...]   bench (compile=true: eager
#       and compiled; more bench overrides after COMPILE, e.g. bench.cost_curves=false)
# tests: tiny random models of every family, every strategy, greedy and seeded sampling, against
# transformers' generate() on the same device. bench: SmolLM2 (or MODEL_PATH), the baseline loop and
# `generate()` in the same run; its report's `identical` column checks every output against the eager loop.
# On an H100 (2026-11-26) bench with compile=true took about 7 min for 6 prompts, 5 of them in the compile
# warm-up and the cost curves: give it 8, or rerun with bench.resume=true (the records kept) if it is cut.
set -uo pipefail
what=${1:?tests or bench}
out=${2:?an output folder}
mkdir -p "$out"
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
case $what in
tests)
    # test_compiled.py in a process of its own (its module fixture compiles once), the property tests
    # over 8 workers where pytest-xdist is installed: on an H100 (2026-11-26) both took about 2 min; on
    # 2026-11-27, with more tests, 215 s were not enough (206 passed): give them 300 s.
    workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
    python3 -m pytest tests/test_compiled.py --device "${3:-cuda}" -q -p no:cacheprovider -rf -W ignore \
        > "$out/compiled_tests.log" 2>&1 &
    python3 -m pytest tests/test_lossless.py tests/test_families.py tests/test_chain_families.py tests/test_suffix.py \
        tests/test_sam_logit_spec.py tests/test_hybrid.py "${workers[@]}" \
        --device "${3:-cuda}" -q -p no:cacheprovider -rf --maxfail=25 -W ignore 2>&1 | tee "$out/tests.log"
    wait
    tail -3 "$out/compiled_tests.log"
    ;;
bench)
    model=(model=smollm2)
    [ -n "${3:-}" ] && model+=("model.path=$3")
    prompts=${4:-../shared/bench/spec_bench_questions.jsonl}
    PYTHONUNBUFFERED=1 python3 -m specfree bench "${model[@]}" device=cuda "compile=${5:-true}" "bench.prompts=$prompts" \
        bench.per_category=1 strategy=hybrid 'bench.strategies=[prompt_lookup, suffix]' 'bench.baselines=[hf_generate]' \
        "bench.out=$out/bench" "${@:6}" 2>&1 | tee "$out/bench.log"
    ;;
*) echo "usage: $0 tests|bench OUT ..." >&2; exit 2 ;;
esac
