#!/usr/bin/env bash
# Run CE (2026-12-03): issue 82's workloads after the cap on an untried row count's price, one after
# another, nothing else running. Intel Xeon VM ("Intel(R) Xeon(R) Processor", family 6 model 167;
# AVX-512 with VNNI, BF16 and AMX), 2 threads, SmolLM2-135M-Instruct Q4_1 at the default precision
# (int8), the cost curve this machine had learned (docs/bench/optimism_cap/learned.json).
set -x
cd /work/main
PY=.venv/bin/python
OUT=docs/bench/run_ce; mkdir -p $OUT
lscpu | grep -E "Model name|CPU family|^Model:|^Flags" > $OUT/machine.txt
cp docs/bench/optimism_cap/learned.json ~/.cache/specfree/costs/f0ef1e9ef92f34bc.json
date; uptime
# 1. Spec-Bench, 24 prompts, compiled: the default and its members
$PY -m specfree bench bench.prompts=/work/shared/bench/spec_bench_questions.jsonl bench.per_category=4 threads=2 compile=true \
    strategy=hybrid 'bench.strategies=[prompt_lookup, suffix]' bench.out=$OUT/spec_bench > $OUT/spec_bench.log 2>&1
date; uptime
# 2. the code-edits workload, 4 prompts a kind
$PY -m specfree bench bench=code_edits bench.per_category=4 threads=2 compile=true strategy=hybrid 'bench.strategies=[prompt_lookup, suffix]' bench.out=$OUT/code_edits > $OUT/code_edits.log 2>&1
date; uptime
# 3. the JSON-schema bench over the 56 tasks: the constrained plain loop, the default and each member
PYTHONPATH=. $PY benchmarks/json_schema_bench.py --tasks 56 --max-new 128 --threads 2 --no-llama-server \
    --systems 'plain,hybrid,hybrid[prompt_lookup],hybrid[suffix]' --out $OUT/json_schema.json > $OUT/json_schema.log 2>&1
date; uptime
# 4. the agent loop, 12 tasks, 3 turns, 96 tokens a turn, with llama-server
PYTHONPATH=. $PY benchmarks/agent_loop_bench.py --tasks 12 --turns 3 --max-new 96 --threads 2 --out $OUT/agent_loop_12.json > $OUT/agent_loop.log 2>&1
date; uptime
echo DONE
