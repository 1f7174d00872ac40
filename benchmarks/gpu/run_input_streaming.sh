#!/usr/bin/env bash
# Text that streams in, on the GPU, in one command:
#   bash benchmarks/gpu/run_input_streaming.sh
# With the PRESET random checkpoint, voxserve, words arriving at WORDS a second over one Triton
# sequence per request:
# 1. one stream at a time, each length its text's ids plus TAIL frames (`--text-tail-frames`), so the
#    last word to the last audio is what the server adds after the text ends; TTFA from the first word
#    and the server's first audio after the text it waited for;
# 2. open loop at RATES with the same lengths: the same figures and stalls under load.
# Results: $OUT/input_single/ and $OUT/input_load/ (results.json, results.md); log in $OUT/log.txt.
# Settings, from the environment (see also common.sh):
#   TRITONSERVER  the tritonserver binary (default: found as `voxtriton serve` finds it)
#   T      time limit of each step in seconds (270)
#   WORDS  words a second (20: an LLM's pace); TAIL frames after the text's last id (12, about 1 s)
#   RATES  open-loop arrival rates (30,60); D seconds of arrivals per rate (20); P more arguments
#   PRESET the model size (1.7b)
set -uo pipefail
source "$(dirname "$0")/common.sh"
PRESET=${PRESET:-1.7b}
checkpoint $PRESET
COMMON="--checkpoint $CKPTS/ck-$PRESET ${TRITONSERVER:+--tritonserver $TRITONSERVER} --policies voxserve
  --text-rate ${WORDS:-20} --text-tail-frames ${TAIL:-12} --warm-up-load 0 ${P:-}"
run timeout ${T:-270} $PY benchmarks/serving_bench.py $COMMON --concurrency 1 --duration ${D:-20} \
  --out $OUT/input_single
run timeout ${T:-270} $PY benchmarks/serving_bench.py $COMMON --param tts:max_positions=512 \
  --max-streams 512 --max-queued 256 --max-draining 768 \
  --param tts:graph_batch_sizes=1,2,4,8,16,32,48,64,96,128,192,256,384,512 \
  --rates ${RATES:-30,60} --duration ${D:-20} --out $OUT/input_load
