#!/usr/bin/env bash
# session 20, call 5 (the last of the budget): concurrent 1.7B at 108 req/s with seeds 2 and 3, then
# voxserve at 124 with seeds 4 and 5; 20 s probes, no warm-up.
cd "$(dirname "$0")/.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > $S 2>&1
cat .carry/HEAD >> $S
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> $S; }
stamp start; checkpoint 1.7b > /dev/null 2>&1; stamp checkpoint
export D=20 W=0
R=benchmarks/gpu/run_serving.sh
T=100 P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25 --repeats 2 --seed 2' bash $R rates 1.7b concurrent 108 cc_108_s2 > /dev/null 2>&1; stamp concurrent
T=100 P='--repeats 2 --seed 4' bash $R rates 1.7b voxserve 124 vx_124_s4 > /dev/null 2>&1; stamp voxserve
grep "rate " $OUT/log.txt | grep "/s" | cut -c1-330; tail -4 $S
cd $OUT && tar czf call5.tgz * --remove-files; ls -la $OUT
