#!/usr/bin/env bash
# voxtriton against vLLM-Omni on one GPU host, one system after the other, the same client and seeds,
# then one table and plot (benchmarks/results/compare_h100.md and compare_h200.md were made this way):
#   bash benchmarks/peers/compare.sh [PRESET]            (PRESET: 1.7b, the default, or 0.6b)
# vLLM-Omni runs twice: with an INITIAL-frame first chunk, then with the chunk ramp RAMP (a deploy-time
# setting, so a second server start). Settings, from the environment: OMNI_RATES (3,4,5: its
# open-loop rates with the first chunk), RAMP (4,4,8,16,25), RAMP_RATES (4,5), VX_RATES (100,112:
# voxtriton's; 70,80 suit an H100), INITIAL (8: first-chunk frames), SAME_CHUNK (2: a second
# single-stream run with voxtriton's first chunk), D (30 s per probe), REPEATS (2), OUT
# (/tmp/voxtriton-gpu-runs), VENV (vLLM-Omni's environment, see vllm_omni/README.md), TRITONSERVER, PY,
# FQ_PYTHONPATH (where faster-qwen3-tts and its transformers 5.15 are, if not in PY's environment:
# single_stream.py then measures it against voxtriton in process; skipped where it does not import).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PRESET=${1:-1.7b}
export OUT=${OUT:-/tmp/voxtriton-gpu-runs} PY=${PY:-python3} D=${D:-30} REPEATS=${REPEATS:-2}
CK=${CKPTS:-/tmp}/ck-$PRESET
PIDFILE=/tmp/vllm-omni-8091.log.pid
[ -f "$CK/speech_tokenizer/model.safetensors" ] || { rm -rf "$CK" && "$PY" -m voxtriton.cli make-checkpoint --preset "$PRESET" "$CK"; }
trap 'kill -- -$(cat $PIDFILE) 2> /dev/null || true' EXIT
stop_omni() {  # keep the deploy config with the runs, then free the GPU for the next server
  cp /tmp/vllm-omni-8091.deploy.yaml "$OUT/$1/"
  kill -- -"$(cat $PIDFILE)"
  sleep 10
}

INITIAL=${INITIAL:-8} bash "$HERE/vllm_omni/serve.sh" "$CK" 8091
INITIAL=${INITIAL:-8} bash "$HERE/vllm_omni/bench.sh" "$CK" single
INITIAL=${SAME_CHUNK:-2} bash "$HERE/vllm_omni/bench.sh" "$CK" single
INITIAL=${INITIAL:-8} bash "$HERE/vllm_omni/bench.sh" "$CK" rates "${OMNI_RATES:-3,4,5}"
stop_omni "vllm-omni-i${INITIAL:-8}_rates"

RAMP=${RAMP:-4,4,8,16,25} bash "$HERE/vllm_omni/serve.sh" "$CK" 8091
LABEL=vllm-omni-ramp bash "$HERE/vllm_omni/bench.sh" "$CK" single
LABEL=vllm-omni-ramp bash "$HERE/vllm_omni/bench.sh" "$CK" rates "${RAMP_RATES:-4,5}"
stop_omni vllm-omni-ramp_rates

if PYTHONPATH=${FQ_PYTHONPATH:-} "$PY" -c "import faster_qwen3_tts" 2> /dev/null; then
  PYTHONPATH=${FQ_PYTHONPATH:-} "$PY" "$ROOT/benchmarks/single_stream.py" --checkpoint "$CK" --runs 5 \
    --frames 100 --json "$OUT/single_stream_$PRESET.json"
else
  echo "faster-qwen3-tts does not import: its single-stream run is skipped"
fi
P="--repeats $REPEATS --concurrency 1" bash "$ROOT/benchmarks/gpu/run_serving.sh" rates "$PRESET" voxserve \
  "${VX_RATES:-100,112}" "voxtriton_$PRESET"
"$PY" "$ROOT/benchmarks/merge_goodput.py" --out "$OUT/compare_$PRESET" \
  "$OUT/vllm-omni-i${INITIAL:-8}_rates" "$OUT/vllm-omni-ramp_rates" "$OUT/voxtriton_$PRESET"
