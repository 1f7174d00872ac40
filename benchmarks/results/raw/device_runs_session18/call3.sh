#!/usr/bin/env bash
# session 18, call 3: voxserve 1.7B at 100 req/s, arrivals of seed 0 (collapsed in call 2) then seed 1
# (passed), one traced server, 20 s probes, no warm-up; the trace report has 5 s windows.
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup3.txt 2>&1
source benchmarks/gpu/common.sh
checkpoint 1.7b > /dev/null 2>&1
export D=20 W=0 T=230 TRACE=1
P='--repeats 2' bash benchmarks/gpu/run_serving.sh rates 1.7b voxserve 100 vx_trace > /dev/null 2>&1
grep "rate " $OUT/log.txt | grep "/s" | cut -c1-420
mv $OUT/log.txt $OUT/setup3.txt /tmp/ 2>/dev/null; tar czf $OUT/call3.tgz -C /tmp log.txt setup3.txt -C $OUT vx_trace.tgz && rm -f $OUT/vx_trace.tgz; ls -la $OUT
