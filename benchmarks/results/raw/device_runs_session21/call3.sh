#!/usr/bin/env bash
# session 21, call 3 (the last of the budget): voxserve 1.7B at 124 req/s, the defaults, then with
# scheduler_catch_up, on one machine; two probes each (seeds 0, 1), 20 s probes, no warm-up,
# max_streams 512, one server after the other.
cd "$(dirname "$0")/.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > $S 2>&1
cat .carry/HEAD >> $S
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> $S; }
stamp start; checkpoint 1.7b > /dev/null 2>&1; stamp checkpoint
export D=20 W=0
R=benchmarks/gpu/run_serving.sh
T=175 P='--repeats 2' bash $R rates 1.7b voxserve 124 vx_default124 > /dev/null 2>&1; stamp vx_default
T=150 P='--repeats 2 --param tts:scheduler_catch_up=true' bash $R rates 1.7b voxserve 124 vx_catchup124 > /dev/null 2>&1; stamp vx_catchup
grep "rate " $OUT/log.txt | grep "/s" | cut -c1-330; tail -4 $S
cd $OUT && tar czf call3.tgz * --remove-files; ls -la $OUT
