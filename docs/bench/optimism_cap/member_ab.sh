F=$HOME/.cache/specfree/costs/f0ef1e9ef92f34bc.json
P=.venv/bin/python
for round in 1 2 3; do
  cp docs/bench/optimism_cap/learned.json $F; $P docs/bench/optimism_cap/member_ab.py hybrid strategy=hybrid 2>/dev/null
  cp docs/bench/optimism_cap/learned.json $F; $P docs/bench/optimism_cap/member_ab.py hybrid_pl1 strategy=hybrid "strategy.drafters=[{name:prompt_lookup,num_candidates:1},suffix]" 2>/dev/null
  cp docs/bench/optimism_cap/learned.json $F; $P docs/bench/optimism_cap/member_ab.py suffix strategy=suffix 2>/dev/null
  cp docs/bench/optimism_cap/learned.json $F; $P docs/bench/optimism_cap/member_ab.py prompt_lookup strategy=prompt_lookup 2>/dev/null
done
cp docs/bench/optimism_cap/learned.json $F
