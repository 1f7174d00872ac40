#!/usr/bin/env bash
# GPU tests, decode attention's launch shapes, model speed (0.6B and 1.7B random checkpoints) and
# single-stream TTFA/RTF (against faster-qwen3-tts when it is installed). Writes $OUT/log.txt and
# four JSON files in $OUT.
set -uo pipefail
source "$(dirname "$0")/common.sh"
run nvidia-smi -L
run timeout 300 $PY -m pytest tests/test_kernels.py tests/test_gpu.py -q -p no:cacheprovider -x
run timeout 180 $PY benchmarks/attention_speed.py --json $OUT/attention_speed.json
checkpoint 1.7b
checkpoint 0.6b
for preset in 1.7b 0.6b; do
  run timeout 240 $PY benchmarks/model_speed.py --checkpoint $CKPTS/ck-$preset --preset $preset --device cuda \
    --graphs --batch-sizes 1,2,4,8,16,32,64,128,256 --context 512 --json $OUT/model_speed_$preset.json
done
run timeout 240 $PY benchmarks/single_stream.py --checkpoint $CKPTS/ck-1.7b --runs 5 --frames 100 \
  --json $OUT/single_stream_1.7b.json
