F=$HOME/.cache/specfree/costs/f0ef1e9ef92f34bc.json
P=.venv/bin/python
for round in 1 2 3; do for which in cats mt; do for l in before after; do
  cp docs/bench/optimism_cap/learned.json $F; $P docs/bench/run_ce/rank_labels_trial/label_ab.py $l $which 2>/dev/null
done; done; done
cp docs/bench/optimism_cap/learned.json $F
