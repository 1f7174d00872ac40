#!/usr/bin/env bash
# session 16, call 3 (one H200): voxserve 1.7B at and above its limit, traced (where the late chunks
# come from), then the slack margin 0.5 s (default 0.3) at the same rates.
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup3.txt 2>&1
source benchmarks/gpu/common.sh
checkpoint 1.7b > /dev/null 2>&1
export D=20 W=0 T=200
S=benchmarks/gpu/run_serving.sh
TRACE=1 bash $S rates 1.7b voxserve 100,104,108 vx_trace > /dev/null 2>&1
P='--param tts:scheduler_slack_margin_s=0.5' bash $S rates 1.7b voxserve 100,104,108 vx_slack05 > /dev/null 2>&1
grep "rate\|warm-up" $OUT/log.txt | grep "/s:" | cut -c1-330
