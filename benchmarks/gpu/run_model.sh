#!/usr/bin/env bash
# Device run 1: GPU tests, model speed (0.6B and 1.7B random checkpoints), single-stream TTFA/RTF vs
# faster-qwen3-tts. Writes $OUT/log.txt and three JSON files.
set -uo pipefail
source "$(dirname "$0")/common.sh"
run nvidia-smi -L
run timeout 240 $PY -m pytest tests/test_gpu.py -q -p no:cacheprovider -x
checkpoint 1.7b
checkpoint 0.6b
run timeout 240 $PY benchmarks/model_speed.py --checkpoint /tmp/ck-1.7b --preset 1.7b --device cuda --graphs \
  --batch-sizes 1,2,4,8,16,32,64,128,256 --context 512 --json $OUT/model_speed_1.7b.json
run timeout 200 $PY benchmarks/model_speed.py --checkpoint /tmp/ck-0.6b --preset 0.6b --device cuda --graphs \
  --batch-sizes 1,2,4,8,16,32,64,128,256 --context 512 --json $OUT/model_speed_0.6b.json
run timeout 240 $PY benchmarks/single_stream.py --checkpoint /tmp/ck-1.7b --runs 5 --frames 100 --json $OUT/single_stream_1.7b.json
