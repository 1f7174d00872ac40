#!/usr/bin/env bash
# FP8 weights on a GPU: their tests, then benchmarks/fp8_check.py on the 1.7B random checkpoint (bf16
# against FP8: logit error, greedy code agreement over 500 frames, frame step at batch 1/64/256).
# Writes $OUT/log.txt, $OUT/fp8_check.json and $OUT/fp8_check.md.
set -uo pipefail
source "$(dirname "$0")/common.sh"
run nvidia-smi -L
run timeout 300 $PY -m pytest tests/test_fp8.py tests/test_fp8_gpu.py -q -s -p no:cacheprovider -m "not server"
checkpoint 1.7b
run timeout 300 $PY benchmarks/fp8_check.py --checkpoint $CKPTS/ck-1.7b --out $OUT
