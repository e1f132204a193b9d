#!/usr/bin/env bash
# Run CB (2026-12-02, 10:19 UTC): the compiled forward's rows, q|k|v and gate|up shared against separate,
# two rounds alternated, then the roofline. AMD EPYC Zen 5, 2 threads. The separate package is 2f58a20's
# parent: git archive 2f58a20~1 specfree | tar -x -C /tmp/unshared, renamed specfree_unshared in its
# imports (torch.ops.specfree and the C++ kept).
cd /work/main
OUT=docs/bench/run_cb
lscpu | grep -E "Model name|CPU family|^Model:" > $OUT/machine.txt; uptime >> $OUT/machine.txt
for r in 1 2; do
  .venv/bin/python docs/bench/run_cb/forward_rows.py shared 2>/dev/null >> $OUT/forward_rows.jsonl
  PYTHONPATH=/tmp/unshared .venv/bin/python docs/bench/run_cb/forward_rows.py separate specfree_unshared 2>/dev/null >> $OUT/forward_rows.jsonl
done
.venv/bin/python -m specfree roofline --out $OUT/roofline threads=2 > $OUT/roofline.log 2>&1
