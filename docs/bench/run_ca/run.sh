#!/usr/bin/env bash
# The session's quiet measurements, one after another (nothing else running). AMD EPYC Zen 5, 2 threads.
set -x
cd /work/main
PY=.venv/bin/python
OUT=/work/runs/out; mkdir -p $OUT
rm -rf ~/.cache/specfree/costs ~/.cache/specfree/probes   # curves and probe verdicts measured under load
date; uptime
# 1. issue 79: the JSON-schema bench over the 56 tasks, with llama-server and transformers beside
PYTHONPATH=. $PY benchmarks/json_schema_bench.py --tasks 56 --max-new 128 --threads 2 --out $OUT/json_schema.json > $OUT/json_schema.log 2>&1
date; uptime
# 2. issue 82 + README.md#where-it-stands: Spec-Bench, 24 prompts, compiled, the default and its members, llama-server beside
$PY -m specfree bench bench.prompts=/work/shared/bench/spec_bench_questions.jsonl bench.per_category=4 threads=2 compile=true \
    strategy=hybrid 'bench.strategies=[prompt_lookup, suffix]' \
    'bench.baselines=[llama_server, {name: llama_server, spec_type: ngram-mod}]' bench.out=$OUT/spec_bench > $OUT/spec_bench.log 2>&1
date; uptime
# 3. issue 78: old loop against new, processes alternated, then prefill chunks against one call
for r in 1 2 3; do
  PYTHONPATH=/tmp/i78/old $PY docs/bench/one_loop/speed_proc.py specfree_old 48 >> $OUT/speed.jsonl 2>/dev/null
  $PY docs/bench/one_loop/speed_proc.py specfree 48 >> $OUT/speed.jsonl 2>/dev/null
done
PYTHONPATH=. $PY docs/bench/one_loop/prefill.py int8 640 5 > $OUT/prefill.log 2>&1
date; uptime
# 4. issue 80: the agent loop
PYTHONPATH=. $PY benchmarks/agent_loop_bench.py --tasks 4 --turns 3 --max-new 96 --threads 2 --out $OUT/agent_loop.json > $OUT/agent_loop.log 2>&1
date; uptime
# 5. issue 83: the quick start against import torch, three rounds
for r in 1 2 3; do
  /usr/bin/time -f "torch %e s" $PY -c "import torch" 2>> $OUT/startup.txt
  /usr/bin/time -f "specfree_import %e s" $PY -c "import specfree" 2>> $OUT/startup.txt
  /usr/bin/time -f "decode %e s" $PY -m specfree decode threads=2 output=$OUT/quick$r.json prompt="Rewrite in the past tense: The fox jumps over the dog." > $OUT/quick$r.txt 2>> $OUT/startup.txt
done
date; uptime
echo DONE

for r in 1 2 3 4 5; do
  PYTHONPATH=/tmp/i78/old $PY docs/bench/one_loop/speed_proc.py specfree_old 128 >> $OUT/speed2.jsonl 2>/dev/null
  $PY docs/bench/one_loop/speed_proc.py specfree 128 >> $OUT/speed2.jsonl 2>/dev/null
done


PYTHONPATH=. .venv/bin/python benchmarks/agent_loop_bench.py --tasks 12 --turns 3 --max-new 96 --threads 2 --out $OUT/agent_loop_12.json  # run after the rest
