#!/usr/bin/env bash
# CSM on the GPU, in one command:
#   bash benchmarks/gpu/run_csm.sh
# Makes the random csm-1b checkpoint (PRESET), then
# 1. tests/test_csm_gpu.py: CSM's CUDA-graph frame step and prefill equal eager;
# 2. single_stream.py: one stream's TTFA and RTF through the serving code, in process;
# 3. run_serving.sh goodput: each policy's goodput by bisection through the full Triton server,
#    by both definitions (strict and SLO attainment).
# Results: $OUT/single_stream_PRESET.json and $OUT/goodput_PRESET/; log in $OUT/log.txt.
# Settings, from the environment (see also common.sh and run_serving.sh):
#   PRESET    csm-1b (csm-tiny checks the script on a CPU, where its time limits are too short)
#   POLICIES  voxserve,concurrent
#   LOW HIGH STEPS  the bisection's rate range and steps (8, 128, 5)
set -uo pipefail
source "$(dirname "$0")/common.sh"
PRESET=${PRESET:-csm-1b}
checkpoint $PRESET
run timeout 300 $PY -m pytest tests/test_csm_gpu.py -q -p no:cacheprovider -x
run timeout 300 $PY benchmarks/single_stream.py --checkpoint $CKPTS/ck-$PRESET --runs 5 --frames 100 \
  --json $OUT/single_stream_$PRESET.json
bash "$(dirname "$0")/run_serving.sh" goodput $PRESET ${POLICIES:-voxserve,concurrent} \
  ${LOW:-8} ${HIGH:-128} ${STEPS:-5} goodput_$PRESET
