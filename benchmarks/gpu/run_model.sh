#!/usr/bin/env bash
# Device run 1: GPU tests, decode attention's launch shapes, model speed (0.6B and 1.7B random
# checkpoints), single-stream TTFA/RTF vs faster-qwen3-tts. Writes $OUT/log.txt and four JSON files.
set -uo pipefail
source "$(dirname "$0")/common.sh"
run nvidia-smi -L
run timeout 300 $PY -m pytest tests/test_kernels.py tests/test_gpu.py -q -p no:cacheprovider -x
run timeout 180 $PY benchmarks/attention_speed.py --json $OUT/attention_speed.json
checkpoint 1.7b
checkpoint 0.6b
run timeout 240 $PY benchmarks/model_speed.py --checkpoint /tmp/ck-1.7b --preset 1.7b --device cuda --graphs \
  --batch-sizes 1,2,4,8,16,32,64,128,256 --context 512 --json $OUT/model_speed_1.7b.json
run timeout 200 $PY benchmarks/model_speed.py --checkpoint /tmp/ck-0.6b --preset 0.6b --device cuda --graphs \
  --batch-sizes 1,2,4,8,16,32,64,128,256 --context 512 --json $OUT/model_speed_0.6b.json
run timeout 240 $PY benchmarks/single_stream.py --checkpoint /tmp/ck-1.7b --runs 5 --frames 100 --json $OUT/single_stream_1.7b.json
