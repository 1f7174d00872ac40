#!/usr/bin/env bash
# session 21, call 1: voxserve 1.7B with scheduler_catch_up at 124, 128 and 132 req/s, then the
# defaults (catch-up off) at 128 in the same lease; two probes per rate (seeds 0, 1), 20 s probes,
# no warm-up, max_streams 512, one server after the other.
cd "$(dirname "$0")/.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > $S 2>&1
cat .carry/HEAD >> $S
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> $S; }
stamp start; checkpoint 1.7b > /dev/null 2>&1; stamp checkpoint
export D=20 W=0
R=benchmarks/gpu/run_serving.sh
T=270 P='--param tts:scheduler_catch_up=true --repeats 2' bash $R rates 1.7b voxserve 124,128,132 vx_catchup > /dev/null 2>&1; stamp catchup
T=120 P='--repeats 2' bash $R rates 1.7b voxserve 128 vx_default > /dev/null 2>&1; stamp default
grep "rate " $OUT/log.txt | grep "/s" | cut -c1-330; tail -4 $S
cd $OUT && tar czf call1.tgz * --remove-files; ls -la $OUT
