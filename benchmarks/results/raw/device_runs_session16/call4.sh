#!/usr/bin/env bash
# session 16, call 4 (one H200): both policies, 0.6B, fixed rates, no warm-up, one server after the other.
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup4.txt 2>&1
source benchmarks/gpu/common.sh
checkpoint 0.6b > /dev/null 2>&1
export D=20 W=0 T=190
S=benchmarks/gpu/run_serving.sh
P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25' bash $S rates 0.6b concurrent 76,80,84 cc_06b > /dev/null 2>&1
bash $S rates 0.6b voxserve 94,98,102 vx_06b > /dev/null 2>&1
grep "rate\|warm-up" $OUT/log.txt | grep "/s:" | cut -c1-330
