#!/usr/bin/env bash
# session 20, call 3: concurrent 1.7B at 108, 112 and 116 req/s (two probes each, seeds 0, 1);
# 20 s probes, no warm-up.
cd "$(dirname "$0")/.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > $S 2>&1
cat .carry/HEAD >> $S
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> $S; }
stamp start; checkpoint 1.7b > /dev/null 2>&1; stamp checkpoint
export D=20 W=0
R=benchmarks/gpu/run_serving.sh
T=300 P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25 --repeats 2' bash $R rates 1.7b concurrent 108,112,116 cc_high > /dev/null 2>&1; stamp concurrent
grep "rate " $OUT/log.txt | grep "/s" | cut -c1-330; tail -4 $S
cd $OUT && tar czf call3.tgz * --remove-files; ls -la $OUT
