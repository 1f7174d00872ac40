#!/usr/bin/env bash
# session 17, call 4 (written for a fresh H200; it ran on the same, still warm one): both policies at 0.6B on main (admission graphs), fixed rates, no
# warm-up, 20 s probes, one server after the other.
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup4.txt 2>&1
source benchmarks/gpu/common.sh
checkpoint 0.6b > /dev/null 2>&1
export D=20 W=0 T=185
S=benchmarks/gpu/run_serving.sh
P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25' bash $S rates 0.6b concurrent 80,86,92 cc_06b > /dev/null 2>&1
bash $S rates 0.6b voxserve 98,104,110 vx_06b > /dev/null 2>&1
grep "rate\|warm-up" $OUT/log.txt | grep "/s:" | cut -c1-330
