#!/usr/bin/env bash
# session 24, call 5 (same machine as calls 3-4): main (dilated layers as conv2d), 1.7B: voxserve at 124 req/s, concurrent at 108 (doubling schedule); two probes each (seeds 0, 1), 20 s, no warm-up, max_streams 512.
cd "$(dirname "$0")/.." && source benchmarks/gpu/call_setup.sh 1.7b
T=140 P='--repeats 2' bash $R rates 1.7b voxserve 124 vx_main_124 > /dev/null 2>&1; stamp vx_main_124
T=140 P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25 --repeats 2' bash $R rates 1.7b concurrent 108 cc_main_108 > /dev/null 2>&1; stamp cc_main_108
finish call5
