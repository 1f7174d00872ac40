#!/usr/bin/env bash
# session 22, call 3 (the budget's last 395 s): concurrent 1.7B (doubling schedule) at 108 req/s
# without and then with scheduler_catch_up on one machine, one probe each (seed 0), 20 s probes, no
# warm-up, max_streams 512. Calls 1 and 2 named their schedule argument CC, which overwrote the
# image's exported C compiler variable: Triton could not build its kernels and every server fell
# back to PyTorch formulas (a 58 ms frame step). This one names it DOUBLING.
cd "$(dirname "$0")/.." && source benchmarks/gpu/call_setup.sh 1.7b
echo "CC in the environment: ${CC:-unset}" >> "$S"
DOUBLING='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25'
T=150 P="$DOUBLING" bash $R rates 1.7b concurrent 108 cc_default > /dev/null 2>&1; stamp cc_default
T=95 P="$DOUBLING --param tts:scheduler_catch_up=true" bash $R rates 1.7b concurrent 108 cc_catchup > /dev/null 2>&1; stamp cc_catchup
finish call3
