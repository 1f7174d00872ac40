#!/usr/bin/env bash
# Voice cloning on the GPU, in one command:
#   bash benchmarks/gpu/run_clone.sh
# Makes the PRESET-base and PRESET (CustomVoice) random checkpoints (PRESET: 1.7b; 0.6b too), then
# 1. clone_bench.py: TTFA of sequential single streams for a preset speaker (a PRESET server), an
#    inline 10 s reference (x-vector, in-context) and the same reference registered as the voices
#    bench-xvector and bench-in-context (a PRESET-base server, voices in $OUT/clone/voices), each
#    split by the servers' chunk traces (--trace); then the encoders' cost per reference second
#    (3/10/30 s, batches 1 and 8) on the GPU (if any), in process;
# 2. serving_bench.py on the PRESET-base server: open loop at RATES with the registered voices, a share
#    SHARE of requests in-context and the rest x-vector only (SHARE=0: all x-vector only).
# Results: $OUT/clone/clone_bench.{json,md} and $OUT/clone_mix/results.{json,md}; log in $OUT/log.txt.
# Settings, from the environment (see also common.sh):
#   TRITONSERVER  the tritonserver binary (default: found as `voxtriton serve` finds it)
#   T      time limit of each step in seconds (540)
#   RATES  open-loop arrival rates, comma-separated (60,100); D seconds of arrivals per rate (20)
#   SHARE  share of in-context requests in the open loop (0.5)
#   P      more serving_bench arguments, e.g. P='--repeats 2'
#   PRESET the model size (1.7b; 0.6b; tiny checks the script on a CPU, where its 540 s are too few)
set -uo pipefail
source "$(dirname "$0")/common.sh"
PRESET=${PRESET:-1.7b}
checkpoint $PRESET-base
checkpoint $PRESET
BASE=$CKPTS/ck-$PRESET-base
run timeout ${T:-540} $PY benchmarks/clone_bench.py --checkpoint $BASE --preset-checkpoint $CKPTS/ck-$PRESET \
  ${TRITONSERVER:+--tritonserver $TRITONSERVER} --trace --out $OUT/clone
MIX=""
[ "${SHARE:-0.5}" != 0 ] && MIX="--voice-mix bench-in-context:${SHARE:-0.5}"
run timeout ${T:-540} $PY benchmarks/serving_bench.py --checkpoint $BASE \
  ${TRITONSERVER:+--tritonserver $TRITONSERVER} --keep-logs --policies voxserve \
  --param tts:voices_dir=$OUT/clone/voices --voice bench-xvector $MIX \
  --param tts:max_positions=512 --max-streams 512 --max-queued 256 --max-draining 768 \
  --param tts:graph_batch_sizes=1,2,4,8,16,32,48,64,96,128,192,256,384,512 \
  --rates ${RATES:-60,100} --duration ${D:-20} ${P:-} --out $OUT/clone_mix
