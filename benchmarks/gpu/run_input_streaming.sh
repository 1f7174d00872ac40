#!/usr/bin/env bash
# Text that streams in, on the GPU, in one command:
#   bash benchmarks/gpu/run_input_streaming.sh
# With the PRESET random checkpoint, voxserve, each request's text arriving as words over one Triton
# sequence, and each length its text's ids plus TAIL frames (`--text-tail-frames`: speech that ends
# TAIL frames after its text, so the last word to the last audio is what the server adds):
# 1. one stream at a time, at each rate of WORDS: 20 words a second (an LLM's pace, text well ahead
#    of the one id a frame the interleaved layout takes) and 10 (about 13 ids a second, just ahead of
#    12.5 frames a second of speech: a stream waits for its text, so its last word leaves little to
#    generate); TTFA from the first word, the server's first audio after the text it waited for;
# 2. open loop at RATES, words at the first rate of WORDS: the same figures and stalls under load.
# Results: $OUT/input_single_W/ (per words rate W) and $OUT/input_load/ (results.json, results.md);
# log in $OUT/log.txt. Settings, from the environment (see also common.sh):
#   TRITONSERVER  the tritonserver binary (default: found as `voxtriton serve` finds it)
#   T      time limit of each step in seconds (270)
#   WORDS  words-a-second rates, comma-separated (20,10); TAIL frames after the text's last id (12)
#   RATES  open-loop arrival rates (30,60; empty: no open loop); D seconds of arrivals per run (20);
#          P more arguments
#   PRESET the model size (1.7b)
#   TRACE=1 each one-stream run's server writes a chunk trace, and input_single_W/ gets its report
#          (trace_report.json; its last_chunks split the last word to the last audio)
set -uo pipefail
source "$(dirname "$0")/common.sh"
PRESET=${PRESET:-1.7b}
checkpoint $PRESET
WORDS=${WORDS:-20,10}
# One KV-cache size for every run (the default 2048 positions x 256 rows does not fit an 80 GB card
# beside the codec state pool).
COMMON="--checkpoint $CKPTS/ck-$PRESET ${TRITONSERVER:+--tritonserver $TRITONSERVER} --policies voxserve
  --text-tail-frames ${TAIL:-12} --warm-up-load 0 --duration ${D:-20}
  --param tts:max_positions=512 --max-streams 512 --max-queued 256 --max-draining 768
  --param tts:graph_batch_sizes=1,2,4,8,16,32,48,64,96,128,192,256,384,512 ${P:-}"
for words in ${WORDS//,/ }; do
  trace=/tmp/input_trace_$$_$words.jsonl
  run timeout ${T:-270} $PY benchmarks/serving_bench.py $COMMON --text-rate $words --concurrency 1 \
    ${TRACE:+--param tts:chunk_trace_path=$trace} --out $OUT/input_single_$words
  if [ -f $trace ] && [ -d $OUT/input_single_$words ]; then
    $PY benchmarks/chunk_trace_report.py $trace > $OUT/input_single_$words/trace_report.json && rm -f $trace
  fi
done
RATES=${RATES-30,60}
if [ -n "$RATES" ]; then
  run timeout ${T:-270} $PY benchmarks/serving_bench.py $COMMON --text-rate ${WORDS%%,*} \
    --rates $RATES --out $OUT/input_load
fi
