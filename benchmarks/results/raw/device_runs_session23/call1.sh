#!/usr/bin/env bash
# session 23, call 1: (a) the backbone alone at 256-768 rows, rows spread over positions 64-191 (about
# the serving probes' mean attention span: prompts of about 23 positions, 37-250 frames), for the
# ceiling any policy faces; (b) both policies at session 20's limits on one machine with the current
# code (paced cancellation watcher, cancellation_lock_share 0.1), 1.7B, two probes per rate (seeds 0
# and 1), 20 s probes, no warm-up, max_streams 512.
cd "$(dirname "$0")/.." && source benchmarks/gpu/call_setup.sh 1.7b
timeout 120 $PY benchmarks/model_speed.py --preset 1.7b --checkpoint /tmp/ck-1.7b --device cuda --graphs \
  --context 192 --spread --batch-sizes 256,384,512,768 --chunk-frames 4 --json $OUT/ms_ceiling.json > $OUT/ms_ceiling.txt 2>&1
stamp model_speed
DOUBLING='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25'
T=165 P='--repeats 2' bash $R rates 1.7b voxserve 124 vx_124 > /dev/null 2>&1; stamp vx_124
T=125 P="$DOUBLING --repeats 2" bash $R rates 1.7b concurrent 108 cc_108 > /dev/null 2>&1; stamp cc_108
T=125 P='--repeats 2' bash $R rates 1.7b voxserve 128 vx_128 > /dev/null 2>&1; stamp vx_128
finish call1
