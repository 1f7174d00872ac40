#!/usr/bin/env bash
# session 24, call 4: voxserve 1.7B at 120 req/s on 7d3085a (.base: before the codec changes), then
# on main (the dilated layers as conv2d: codec calls 1.07-1.11x faster at 64x8-256x25), one machine,
# two probes each (seeds 0, 1), 20 s, no warm-up, max_streams 512. The server metrics give each
# lane's codec call time under load.
cd "$(dirname "$0")/.." && source benchmarks/gpu/call_setup.sh 1.7b
bash .base/benchmarks/gpu/setup_env.sh >> "$S" 2>&1; stamp base_setup
T=170 P='--repeats 2' bash .base/benchmarks/gpu/run_serving.sh rates 1.7b voxserve 120 vx_base_120 > /dev/null 2>&1; stamp vx_base_120
bash benchmarks/gpu/setup_env.sh >> "$S" 2>&1; stamp main_setup
T=150 P='--repeats 2' bash $R rates 1.7b voxserve 120 vx_main_120 > /dev/null 2>&1; stamp vx_main_120
finish call4
