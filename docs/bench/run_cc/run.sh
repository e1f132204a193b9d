#!/usr/bin/env bash
# Run CC (2026-12-02): the compiled forward's rows with the int8 AVX2 sums of this branch against
# 1fb0a90 (the tree before them, checked out at /tmp/base-wt: git worktree add /tmp/base-wt 1fb0a90),
# two rounds alternated, then the roofline. AMD EPYC Zen 3 (family 25 model 1), AVX2, 2 threads.
cd /work/main
OUT=docs/bench/run_cc
lscpu | grep -E "Model name|CPU family|^Model:" > $OUT/machine.txt; uptime >> $OUT/machine.txt
for r in 1 2; do
  .venv/bin/python docs/bench/run_cb/forward_rows.py int8-sums 2>/dev/null >> $OUT/forward_rows.jsonl
  (cd /tmp && PYTHONPATH=/tmp/base-wt /work/main/.venv/bin/python /work/main/docs/bench/run_cb/forward_rows.py before 2>/dev/null) >> $OUT/forward_rows.jsonl
done
.venv/bin/python -m specfree roofline --out $OUT/roofline threads=2 > $OUT/roofline.log 2>&1
