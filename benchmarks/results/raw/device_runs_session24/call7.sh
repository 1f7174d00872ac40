#!/usr/bin/env bash
# session 24, call 7 (same machine as calls 3-6): main, 1.7B, concurrent at 96 req/s (doubling schedule); two probes (seeds 0, 1), 20 s, no warm-up, max_streams 512.
cd "$(dirname "$0")/.." && source benchmarks/gpu/call_setup.sh 1.7b
T=120 P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25 --repeats 2' bash $R rates 1.7b concurrent 96 cc_main_96 > /dev/null 2>&1; stamp cc_main_96
finish call7
