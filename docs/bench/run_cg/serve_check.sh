#!/bin/bash
# serve: seconds to /health 200, then 10 requests (each its own prompt) and their times
cd /work/main
PORT=${PORT:-8123}
start=$(date +%s.%N)
.venv/bin/python -m specfree serve threads=2 serve.port=$PORT > /tmp/serve.log 2>&1 &
pid=$!
until curl -s -o /dev/null -w "%{http_code}" localhost:$PORT/health 2>/dev/null | grep -q 200; do sleep 0.05; done
echo "health after $(echo "$(date +%s.%N) - $start" | bc) s"
for i in $(seq 1 10); do
  curl -s -o /tmp/resp.json -w "request $i %{time_total} s\n" localhost:$PORT/v1/chat/completions -H 'content-type: application/json' \
   -d '{"messages":[{"role":"user","content":"Request '$i': rewrite in the past tense: The fox '$i' jumps over the dog."}],"max_tokens":16,"temperature":0}'
done
cat /tmp/resp.json | head -c 400; echo
kill $pid
