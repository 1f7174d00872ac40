#!/usr/bin/env bash
# session 17, call 3 (same H200): concurrent 1.7B on main (the baseline), then voxserve on main with
# switch_interval_ms 1 (default 5).
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup3.txt 2>&1
export D=20 W=0 T=200
S=benchmarks/gpu/run_serving.sh
P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25' bash $S rates 1.7b concurrent 80,84,88 cc_main > /dev/null 2>&1
P='--param tts:switch_interval_ms=1' bash $S rates 1.7b voxserve 100,104,108 vx_switch1 > /dev/null 2>&1
grep "rate\|warm-up" $OUT/log.txt | grep "/s:" | cut -c1-400
