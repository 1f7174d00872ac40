#!/usr/bin/env bash
# session 19, call 4: voxserve 1.7B at 104, 108 and 112 req/s, then concurrent at 88 and 92, two
# probes per rate (seeds 0, 1), 20 s probes, no warm-up, one server after the other.
cd "$(dirname "$0")/.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > $S 2>&1
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> $S; }
stamp start; checkpoint 1.7b > /dev/null 2>&1; stamp checkpoint
export D=20 W=0
R=benchmarks/gpu/run_serving.sh
T=290 P='--repeats 2' bash $R rates 1.7b voxserve 104,108,112 vx > /dev/null 2>&1; stamp voxserve
T=210 P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25 --repeats 2' bash $R rates 1.7b concurrent 88,92 cc_high > /dev/null 2>&1; stamp concurrent
grep "rate " $OUT/log.txt | grep "/s" | cut -c1-330; tail -4 $S
cd $OUT && tar czf call4.tgz * --remove-files; ls -la $OUT
