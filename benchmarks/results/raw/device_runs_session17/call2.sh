#!/usr/bin/env bash
# session 17, call 2 (same H200): voxserve 1.7B on d3f471d (.base: eager admissions) then on main
# (admission and row-move graphs), fixed rates, no warm-up, 20 s probes, one server after the other.
cd "$(dirname "$0")/.."
export D=20 W=0 T=210
bash .base/benchmarks/gpu/setup_env.sh > $OUT/setup2.txt 2>&1
bash .base/benchmarks/gpu/run_serving.sh rates 1.7b voxserve 96,100,104 vx_base > /dev/null 2>&1
bash benchmarks/gpu/setup_env.sh >> $OUT/setup2.txt 2>&1
bash benchmarks/gpu/run_serving.sh rates 1.7b voxserve 96,100,104 vx_main > /dev/null 2>&1
grep "rate\|warm-up" $OUT/log.txt | grep "/s:" | cut -c1-400
