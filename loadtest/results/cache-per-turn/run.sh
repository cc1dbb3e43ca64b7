#!/bin/bash
# the per-turn cache demo, in its own scheduling autogroup at nice -10 (as the overhead bench)
cd /work/main
echo -10 > /proc/$$/autogroup
taskset -c 1 .venv/bin/python -m standin --port 8216 --ttft-ms 50 --itl-ms 10 --tokens 32 --prompt-tokens-details > /tmp/standin-cache.log 2>&1 &
SP=$!
for i in $(seq 50); do curl -sf localhost:8216/health >/dev/null && break; sleep 0.2; done
uptime
timeout 300 taskset -c 0 .venv/bin/python -m loadtest --url http://127.0.0.1:8216 --model standin --scenario itinerary --turns 6 --concurrency 4 --num-requests 48 --max-tokens 32 --metrics-url http://127.0.0.1:8216/metrics --engine-timings-url http://127.0.0.1:8216/_standin/timings --progress off --output loadtest/results/cache-per-turn
uptime
kill $SP
