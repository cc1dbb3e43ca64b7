#!/bin/bash
# The bounded benchmark (about 12 minutes): stand-in on core 1, load tester on core 0, loopback.
# Run under `setsid` so that these processes form their own scheduling autogroup, whose nice
# is set to -10: the kernel's autogroups make a plain `nice` useless against other sessions.
#
# Each label runs the old configuration (the interpreter's default GC) and the new one (GC
# frozen during a run, the default since this change) back to back at every level:
# - "shared machine": as the machine is, only niced (other engineers' work competes for the cores);
# - "a core each": both processes SCHED_FIFO (chrt), so that nothing else runs on their cores
#   while they are ready: what the load tester adds by itself.
cd /work/main
echo -10 > /proc/$$/autogroup
OUT=${OUT:-loadtest/results/client-overhead}
TAG=${TAG:-$(date -u +%H:%M)}
COMMON="--url http://127.0.0.1:8214 --concurrency 1,8,32,128,256,512 --rate 50,100,200,300,400,600
  --min-requests 100 --output $OUT --gc default,frozen"
for MODE in shared core; do
    RT=""
    LABEL="$TAG, shared machine (nice -10): default GC vs frozen GC"
    if [ $MODE = core ]; then
        RT="chrt -f 20"
        LABEL="$TAG, a core each (SCHED_FIFO): default GC vs frozen GC"
    fi
    $RT taskset -c 1 .venv/bin/python -m standin --port 8214 --ttft-ms 100 --itl-ms 50 --tokens 16 \
        > /tmp/standin-bench.log 2>&1 &
    SP=$!
    for i in $(seq 50); do curl -sf localhost:8214/health >/dev/null && break; sleep 0.2; done
    timeout 900 $RT taskset -c 0 .venv/bin/python -m loadtest.selfcheck $COMMON --server-pid $SP --label "$LABEL"
    kill $SP
    wait $SP 2>/dev/null
done
