#!/usr/bin/env bash
# session 22, call 1: on one machine, each policy at its session-20 limit without and with
# scheduler_catch_up: voxserve 1.7B at 124 req/s, concurrent (doubling schedule) at 108; two probes
# per server (seeds 0, 1), 20 s probes, no warm-up, max_streams 512, one server after the other,
# defaults and catch-up alternating so neither always runs first.
cd "$(dirname "$0")/.." && source benchmarks/gpu/call_setup.sh 1.7b
CC='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25'
CU='--param tts:scheduler_catch_up=true'
T=170 P='--repeats 2' bash $R rates 1.7b voxserve 124 vx_default > /dev/null 2>&1; stamp vx_default
T=130 P="$CC $CU --repeats 2" bash $R rates 1.7b concurrent 108 cc_catchup > /dev/null 2>&1; stamp cc_catchup
T=130 P="$CU --repeats 2" bash $R rates 1.7b voxserve 124 vx_catchup > /dev/null 2>&1; stamp vx_catchup
T=130 P="$CC --repeats 2" bash $R rates 1.7b concurrent 108 cc_default > /dev/null 2>&1; stamp cc_default
finish call1
