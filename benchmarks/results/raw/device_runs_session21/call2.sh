#!/usr/bin/env bash
# session 21, call 2 (same lease as call 1): voxserve 1.7B defaults at 124 req/s, then concurrent
# (doubling schedule) at 108 without and with scheduler_catch_up; two probes per rate (seeds 0, 1),
# 20 s probes, no warm-up, max_streams 512, one server after the other.
cd "$(dirname "$0")/.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > $S 2>&1
cat .carry/HEAD >> $S
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> $S; }
stamp start; checkpoint 1.7b > /dev/null 2>&1; stamp checkpoint
export D=20 W=0
R=benchmarks/gpu/run_serving.sh
CC='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25 --repeats 2'
T=125 P='--repeats 2' bash $R rates 1.7b voxserve 124 vx_default124 > /dev/null 2>&1; stamp vx_default
T=125 P="$CC" bash $R rates 1.7b concurrent 108 cc_default > /dev/null 2>&1; stamp cc_default
T=125 P="$CC --param tts:scheduler_catch_up=true" bash $R rates 1.7b concurrent 108 cc_catchup > /dev/null 2>&1; stamp cc_catchup
grep "rate " $OUT/log.txt | grep "/s" | cut -c1-330; tail -5 $S
cd $OUT && tar czf call2.tgz * --remove-files; ls -la $OUT
