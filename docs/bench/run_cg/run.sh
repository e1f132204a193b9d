#!/usr/bin/env bash
# Run CG (2026-12-04): the session's quiet measurements, one after another, nothing else running.
# AMD EPYC VM ("AMD EPYC", family 26 model 2: Zen 5; AVX-512 with VNNI and BF16), 2 threads,
# SmolLM2-135M-Instruct Q4_1 at the default precision (int8), the compiled forward.
set -x
cd /work/main
PY=.venv/bin/python
OUT=docs/bench/run_cg; mkdir -p $OUT
lscpu | grep -E "Model name|CPU family|^Model:|^Flags" > $OUT/machine.txt
rm -rf ~/.cache/specfree/costs ~/.cache/specfree/probes   # curves and probe verdicts measured under load
$PY -m specfree warm-up threads=2 > $OUT/warm_up.log 2>&1   # as the set-up line ends (README.md#set-up-and-test)
date; uptime
# 1. issue 81: the compiled forward at 1-16 rows after 256 tokens, and the roofline
$PY docs/bench/run_cb/forward_rows.py now 2>/dev/null >> $OUT/forward_rows.jsonl
$PY -m specfree roofline --out $OUT/roofline threads=2 > $OUT/roofline.log 2>&1
date; uptime
# 2. issue 83: the quick start against import torch, three rounds alternated; then serve
for r in 1 2 3; do
  /usr/bin/time -f "torch %e s" $PY -c "import torch" 2>> $OUT/startup.txt
  /usr/bin/time -f "specfree_import %e s" $PY -c "import specfree" 2>> $OUT/startup.txt
  /usr/bin/time -f "decode %e s" $PY -m specfree decode threads=2 output=$OUT/quick$r.json prompt="Rewrite in the past tense: The fox jumps over the dog." > $OUT/quick$r.txt 2>> $OUT/startup.txt
done
bash docs/bench/run_cg/serve_check.sh > $OUT/serve_check.txt 2>&1
date; uptime
# 3. issues 81 and 82: Spec-Bench, 24 prompts, compiled: the default and its members, llama-server beside
$PY -m specfree bench bench.prompts=/work/shared/bench/spec_bench_questions.jsonl bench.per_category=4 threads=2 compile=true \
    strategy=hybrid 'bench.strategies=[prompt_lookup, suffix]' \
    'bench.baselines=[llama_server, {name: llama_server, spec_type: ngram-mod}]' bench.out=$OUT/spec_bench > $OUT/spec_bench.log 2>&1
date; uptime
# 4. issue 82: the code-edits workload, 4 prompts a kind
$PY -m specfree bench bench=code_edits bench.per_category=4 threads=2 compile=true strategy=hybrid \
    'bench.strategies=[prompt_lookup, suffix]' 'bench.baselines=[]' bench.out=$OUT/code_edits > $OUT/code_edits.log 2>&1
date; uptime
echo DONE
