#!/bin/bash
# The bounded benchmark (about 8 minutes): stand-in on core 1, load tester on core 0, loopback.
# Run under `setsid` so that these processes form their own scheduling autogroup, whose nice
# is set to -10: the kernel's autogroups make a plain `nice` useless against other sessions.
cd /work/main
echo -10 > /proc/$$/autogroup
cat /proc/$$/autogroup
OUT=${OUT:-loadtest/results/client-overhead}
taskset -c 1 .venv/bin/python -m tests.standin --port 8214 --ttft-ms 100 --itl-ms 50 --tokens 16 > /tmp/standin-bench.log 2>&1 &
SP=$!
for i in $(seq 50); do curl -sf localhost:8214/health >/dev/null && break; sleep 0.2; done
COMMON="--url http://127.0.0.1:8214 --rate 50,100,200,300 --min-requests 100 --output $OUT"
timeout 900 taskset -c 0 .venv/bin/python -m loadtest.selfcheck $COMMON --label "before/after: httpx vs loadtest.transport, both on asyncio" --http-client httpx,raw --loop asyncio
timeout 900 taskset -c 0 .venv/bin/python -m loadtest.selfcheck $COMMON --label "after: loadtest.transport on uvloop (the default)" --http-client raw --loop uvloop
kill $SP
