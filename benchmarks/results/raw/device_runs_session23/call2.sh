#!/usr/bin/env bash
# session 23, call 2: call 1 failed both policies at session 20's limits (voxserve 124, concurrent
# 108). Lower rates on one machine with the current code, for this build's goodput ratio: voxserve
# 114 and 120, concurrent 98 and 104, two probes each (seeds 0 and 1), 20 s probes, no warm-up,
# max_streams 512.
cd "$(dirname "$0")/.." && source benchmarks/gpu/call_setup.sh 1.7b
DOUBLING='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25'
T=270 P='--repeats 2' bash $R rates 1.7b voxserve 114,120 vx_114_120 > /dev/null 2>&1; stamp vx_114_120
T=245 P="$DOUBLING --repeats 2" bash $R rates 1.7b concurrent 98,104 cc_98_104 > /dev/null 2>&1; stamp cc_98_104
finish call2
