#!/usr/bin/env bash
# Measure a running vLLM-Omni (serve.sh) with serving_bench.py's openai target: the workload,
# client-side TTFA and stall accounting, and report that voxtriton's runs use.
#   bash bench.sh CHECKPOINT single              one stream at a time (closed loop of 1) for D s
#   bash bench.sh CHECKPOINT rates 2,3,4         open loop (Poisson) at each rate, REPEATS probes each
#   bash bench.sh CHECKPOINT goodput LOW HIGH    goodput by both definitions, bisection in [LOW, HIGH]
# Environment: PY (python3, with voxtriton installed: its benchmark client), PORT (8091), OUT
# (/tmp/voxtriton-gpu-runs), LABEL (vllm-omni-i$INITIAL), INITIAL (8: first-chunk frames asked per
# request; a RAMP set at serve time overrides it), D (30 s per probe), W (10: seconds of warm-up
# load at the lowest rate, not counted, as benchmarks/gpu/run_serving.sh), REPEATS (2), SEED (0),
# GPUS (1: the GPUs the server computes on, e.g. REPLICAS of serve.sh; on several, results are also
# given per GPU and rates are per GPU), P (more serving_bench arguments).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
CK=$(realpath "$1") MODE=$2
PY=${PY:-python3} PORT=${PORT:-8091} OUT=${OUT:-/tmp/voxtriton-gpu-runs}
INITIAL=${INITIAL:-8} D=${D:-30} REPEATS=${REPEATS:-2} SEED=${SEED:-0}
LABEL=${LABEL:-vllm-omni-i$INITIAL} GPUS=${GPUS:-1}
NAME=$LABEL  # the output directory's prefix
[ "$GPUS" -gt 1 ] && NAME=${LABEL}_${GPUS}gpus
# vLLM-Omni's fields: a preset voice (CustomVoice), raw PCM streamed as generated, and the first
# chunk's size; the fixed length is max_new_tokens (talker frames at 12.5 Hz). It takes no seed.
EXTRA="{\"task_type\": \"CustomVoice\", \"language\": \"English\", \"stream\": true, \
\"stream_format\": \"audio\", \"initial_codec_chunk_frames\": $INITIAL}"
BENCH=("$PY" "$ROOT/benchmarks/serving_bench.py" --target openai --url "http://127.0.0.1:$PORT"
  --model "$CK" --voice ryan --label "$LABEL" --length-field max_new_tokens --seed-field ''
  --extra-body "$EXTRA" --duration "$D" --seed "$SEED" --warm-up-load "${W:-10}" --gpus "$GPUS"
  --rates-per-server ${P:-})
case $MODE in
  single) "${BENCH[@]}" --concurrency 1 --out "$OUT/${NAME}_single" ;;
  rates) "${BENCH[@]}" --rates "$3" --repeats "$REPEATS" --out "$OUT/${NAME}_rates" ;;
  goodput) "${BENCH[@]}" --goodput --rate-low "$3" --rate-high "$4" --repeats "$REPEATS" \
    --out "$OUT/${NAME}_goodput" ;;
  *) echo "unknown mode $MODE: single, rates or goodput"; exit 2 ;;
esac
