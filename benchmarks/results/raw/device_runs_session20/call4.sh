#!/usr/bin/env bash
# session 20, call 4: two voxserve settings at 124 and 128 req/s (1.7B, two probes each, seeds 0,
# 1, 20 s probes, no warm-up): slack margin 0.5 s, then the doubling chunk schedule 2,2,4,8,16,25.
cd "$(dirname "$0")/.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > $S 2>&1
cat .carry/HEAD >> $S
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> $S; }
stamp start; checkpoint 1.7b > /dev/null 2>&1; stamp checkpoint
export D=20 W=0
R=benchmarks/gpu/run_serving.sh
T=190 P='--param tts:scheduler_slack_margin_s=0.5 --repeats 2' bash $R rates 1.7b voxserve 124,128 vx_slack05 > /dev/null 2>&1; stamp slack
T=190 P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25 --repeats 2' bash $R rates 1.7b voxserve 124,128 vx_doubling > /dev/null 2>&1; stamp doubling
grep "rate " $OUT/log.txt | grep "/s" | cut -c1-330; tail -4 $S
cd $OUT && tar czf call4.tgz * --remove-files; ls -la $OUT
