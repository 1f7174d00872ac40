#!/usr/bin/env bash
# session 23, call 3 (the budget's last ~430 s): one probe each, one machine, below call 2's results
# (voxserve passed 114 in 1 of 2; concurrent failed 98 in both): voxserve 112, concurrent 96 (seed 0),
# 20 s probes, no warm-up, max_streams 512.
cd "$(dirname "$0")/.." && source benchmarks/gpu/call_setup.sh 1.7b
DOUBLING='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25'
T=110 bash $R rates 1.7b voxserve 112 vx_112 > /dev/null 2>&1; stamp vx_112
T=95 P="$DOUBLING" bash $R rates 1.7b concurrent 96 cc_96 > /dev/null 2>&1; stamp cc_96
finish call3
