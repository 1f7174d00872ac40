#!/usr/bin/env bash
# voxtriton against vLLM-Omni on one GPU host, one system after the other, the same client and seeds,
# then one table and plot (benchmarks/results/compare_h200.md was made this way):
#   bash benchmarks/peers/compare.sh [PRESET]            (PRESET: 1.7b, the default, or 0.6b)
# Settings, from the environment: OMNI_RATES (3,4: vLLM-Omni's open-loop rates), VX_RATES (100,112),
# INITIAL (8: vLLM-Omni's first-chunk frames), SAME_CHUNK (2: a second single-stream run of vLLM-Omni
# with voxtriton's first chunk), D (30 s per probe), REPEATS (2), OUT (/tmp/voxtriton-gpu-runs),
# VENV (vLLM-Omni's environment, see vllm_omni/README.md), TRITONSERVER, PY.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PRESET=${1:-1.7b}
export OUT=${OUT:-/tmp/voxtriton-gpu-runs} PY=${PY:-python3} D=${D:-30} REPEATS=${REPEATS:-2}
CK=${CKPTS:-/tmp}/ck-$PRESET
[ -f "$CK/speech_tokenizer/model.safetensors" ] || "$PY" -m voxtriton.cli make-checkpoint --preset "$PRESET" "$CK"

INITIAL=${INITIAL:-8} bash "$HERE/vllm_omni/serve.sh" "$CK" 8091
trap 'kill -- -$(cat /tmp/vllm-omni-8091.log.pid) 2> /dev/null || true' EXIT
INITIAL=${INITIAL:-8} bash "$HERE/vllm_omni/bench.sh" "$CK" single
INITIAL=${SAME_CHUNK:-2} bash "$HERE/vllm_omni/bench.sh" "$CK" single
INITIAL=${INITIAL:-8} bash "$HERE/vllm_omni/bench.sh" "$CK" rates "${OMNI_RATES:-3,4}"
cp /tmp/vllm-omni-8091.deploy.yaml "$OUT/vllm-omni-i${INITIAL:-8}_rates/"
kill -- -"$(cat /tmp/vllm-omni-8091.log.pid)"
sleep 10  # its GPU memory is free before voxtriton starts

P="--repeats $REPEATS --concurrency 1" bash "$ROOT/benchmarks/gpu/run_serving.sh" rates "$PRESET" voxserve \
  "${VX_RATES:-100,112}" "voxtriton_$PRESET"
"$PY" "$ROOT/benchmarks/merge_goodput.py" --out "$OUT/compare_$PRESET" \
  "$OUT/vllm-omni-i${INITIAL:-8}_rates" "$OUT/voxtriton_$PRESET"
