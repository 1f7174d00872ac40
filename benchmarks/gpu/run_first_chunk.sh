#!/usr/bin/env bash
# A 1-frame first chunk under light load (tts `scheduler_single_frame_start_streams`), in one command:
#   bash benchmarks/gpu/run_first_chunk.sh
# With the PRESET random checkpoint and voxserve, three servers one after the other: the setting at 0
# (every stream starts with the schedule's first size), at LIGHT streams (16, a GPU's default) with
# `early_first_frames` off (the first frame comes with its whole step), and at LIGHT with it on
# (the default: the first frame comes before the talker advances); these three without the hold for
# first chunks (`scheduler_first_chunk_hold_s` 0). With RUNS naming `light_hold`, a fourth at LIGHT
# that holds the backbone while a first chunk decodes (HOLD, 0.02 s: a GPU's default):
# 1. closed loop at each stream count of CONCURRENCY: TTFA and stalls where the setting starts
#    streams with one frame (up to LIGHT open) and where it stops;
# 2. open loop at RATES, REPEATS probes each: a load above LIGHT streams, where both should match.
# Results: $OUT/first_chunk_off/, $OUT/first_chunk_light_whole_step/, $OUT/first_chunk_light/ (and
# $OUT/first_chunk_light_hold/) (results.json, results.md); log in
# $OUT/log.txt. Settings, from the environment (see also common.sh):
#   TRITONSERVER  the tritonserver binary (default: found as `voxtriton serve` finds it)
#   LIGHT        the setting's stream count (16); CONCURRENCY (1,8,32,64); D seconds per run (15)
#   RATES        open-loop arrival rates (100; empty: none); REPEATS probes per rate (2); T time limit
#                per server (280)
#   PRESET       the model size (1.7b); RUNS which servers, in order (off light_whole_step light)
#   HOLD         light_hold's `scheduler_first_chunk_hold_s` (0.02)
set -uo pipefail
source "$(dirname "$0")/common.sh"
PRESET=${PRESET:-1.7b}
checkpoint $PRESET
COMMON="--checkpoint $CKPTS/ck-$PRESET ${TRITONSERVER:+--tritonserver $TRITONSERVER} --policies voxserve
  --param tts:max_positions=512 --max-streams 512 --max-queued 256 --max-draining 768
  --param tts:graph_batch_sizes=1,2,4,8,16,32,48,64,96,128,192,256,384,512 --warm-up-load 5
  --duration ${D:-15} --repeats ${REPEATS:-2}"
for name in ${RUNS:-off light_whole_step light}; do
  streams=${LIGHT:-16} early=true hold=0
  [ $name = off ] && streams=0
  [ $name = light_whole_step ] && early=false
  [ $name = light_hold ] && hold=${HOLD:-0.02}
  rates=${RATES-100}
  run timeout ${T:-280} $PY benchmarks/serving_bench.py $COMMON \
    --param tts:scheduler_single_frame_start_streams=$streams --param tts:early_first_frames=$early \
    --param tts:scheduler_first_chunk_hold_s=$hold --concurrency ${CONCURRENCY:-1,8,32,64} \
    ${rates:+--rates $rates} --out $OUT/first_chunk_$name
done
