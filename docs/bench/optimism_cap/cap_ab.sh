F=$HOME/.cache/specfree/costs/f0ef1e9ef92f34bc.json
for round in 1 2 3; do
 for curve in learned quick; do
  for v in "0.0625 0.0625" "0.0625 0.5" "0.5 0.5"; do
   for s in hybrid suffix; do
    cp docs/bench/optimism_cap/$curve.json $F
    .venv/bin/python docs/bench/optimism_cap/cap_ab.py $s $v $curve 2>/dev/null
   done
  done
 done
done
cp docs/bench/optimism_cap/learned.json $F
