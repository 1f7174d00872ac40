#!/usr/bin/env bash
# Device run 2: the full Triton server on the GPU (MPS, green contexts, BLS with GPU tensors).
# Usage: run_serving.sh lanes|goodput. Writes $OUT/log.txt and $OUT/<mode>/results.{json,md} + plots.
set -uo pipefail
source "$(dirname "$0")/common.sh"
[ -f /tmp/ck-1.7b/speech_tokenizer/model.safetensors ] || run $PY -m voxtriton.cli make-checkpoint --preset 1.7b /tmp/ck-1.7b
COMMON="--checkpoint /tmp/ck-1.7b --tritonserver /tmp/tri/pytriton/tritonserver/bin/tritonserver --param tts:max_positions=512"
case "$1" in
  lanes)
    run timeout 560 $PY benchmarks/serving_bench.py $COMMON --policies voxserve,concurrent,serial \
      --concurrency 1,8,32,128 --duration 12 --out $OUT/lanes ;;
  goodput)
    run timeout 560 $PY benchmarks/serving_bench.py $COMMON --policies voxserve,concurrent --goodput \
      --rate-low 1 --rate-high 32 --bisection-steps 3 --duration 12 --keep-logs --out $OUT/goodput ;;
esac
