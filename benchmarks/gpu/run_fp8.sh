#!/usr/bin/env bash
# FP8 weights and the FP8 KV cache on a GPU: their tests, then benchmarks/fp8_check.py on the 1.7B
# random checkpoint (bf16 against FP8 weights, the FP8 KV caches alone and with FP8 weights: logit
# error, greedy code agreement over 500 frames, frame step at batch 1/64/256, decode attention alone).
# Writes $OUT/log.txt, $OUT/fp8_check.json and $OUT/fp8_check.md.
set -uo pipefail
source "$(dirname "$0")/common.sh"
run nvidia-smi -L
run timeout 600 $PY -m pytest tests/test_fp8.py tests/test_fp8_kv.py tests/test_fp8_gpu.py tests/test_kernels.py \
  -q -s -p no:cacheprovider -m "not server"
checkpoint 1.7b
run timeout 1200 $PY benchmarks/fp8_check.py --checkpoint $CKPTS/ck-1.7b --variants talker,all,kv-talker,kv,all+kv \
  --out $OUT
