#!/usr/bin/env bash
# session 16, call 2 (same H200): both policies, 1.7B, fixed rates, no warm-up, one server after the other.
cd "$(dirname "$0")/.."
source benchmarks/gpu/common.sh
export D=20 W=0 T=250
S=benchmarks/gpu/run_serving.sh
P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25' bash $S rates 1.7b concurrent 80,84,88,92 cc_17b > /dev/null 2>&1
bash $S rates 1.7b voxserve 92,96,100,104 vx_17b > /dev/null 2>&1
grep "rate\|warm-up" $OUT/log.txt | grep "/s:" | cut -c1-330
