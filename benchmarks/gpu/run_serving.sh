#!/usr/bin/env bash
# Device runs 2 and 3: the full Triton server on the GPU (MPS, green contexts, BLS, codec state pool).
# Usage: run_serving.sh lanes|goodput|multi [PRESET]. Writes $OUT/log.txt and $OUT/<mode>/results.{json,md} + plots.
#   goodput: voxserve, concurrent and serial on one GPU;
#   multi (two GPUs): voxserve on one GPU, on two (one server per GPU), and disaggregated.
set -uo pipefail
source "$(dirname "$0")/common.sh"
PRESET=${2:-1.7b}
CK=/tmp/ck-$PRESET
[ -f $CK/speech_tokenizer/model.safetensors ] || run $PY -m voxtriton.cli make-checkpoint --preset $PRESET $CK
COMMON="--checkpoint $CK --tritonserver /tmp/tri/pytriton/tritonserver/bin/tritonserver --param tts:max_positions=512 --keep-logs"
GOODPUT="--goodput --bisection-steps 3 --duration 10"
case "$1" in
  lanes)
    run timeout 590 $PY benchmarks/serving_bench.py $COMMON --policies voxserve,concurrent,serial \
      --concurrency 1,8,32,128 --duration 12 --out $OUT/lanes ;;
  goodput)
    run timeout 590 $PY benchmarks/serving_bench.py $COMMON --policies voxserve,concurrent,serial $GOODPUT \
      --rate-low 4 --rate-high 48 --out $OUT/goodput_$PRESET ;;
  multi)
    run timeout 590 $PY benchmarks/serving_bench.py $COMMON --policies 'voxserve,voxserve*2,disaggregated' $GOODPUT \
      --rate-low 4 --rate-high 96 --out $OUT/multi_$PRESET ;;
esac
