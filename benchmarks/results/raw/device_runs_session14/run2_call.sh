#!/usr/bin/env bash
# session 14, call 2 (x2): background_max_batch 64 (new default) / 128 vs concurrent's limit
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup.txt 2>&1
nvidia-smi -L >> $OUT/setup.txt; git log --oneline -1 >> $OUT/setup.txt 2>&1
source benchmarks/gpu/common.sh
checkpoint 1.7b > /dev/null 2>&1
export D=20
S=benchmarks/gpu/run_serving.sh
DBL='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25'
(
  T=200 bash $S rates 1.7b voxserve@0 92,96,100 vx_bg64_a
  T=200 P='--param tts:scheduler_background_max_batch=128' bash $S rates 1.7b voxserve@0 96,100,104 vx_bg128
) > /dev/null 2>&1 &
(
  T=170 P="$DBL" bash $S rates 1.7b concurrent@1 78,80,82 cc_double_b
  T=200 bash $S rates 1.7b voxserve@1 94,98,102 vx_bg64_b
) > /dev/null 2>&1 &
wait
for d in $OUT/*.tgz; do echo "== $d"; tar xzf $d -O --wildcards '*/results.md' | grep "^| [a-z]" | grep -v "^| policy" | cut -d'|' -f2-12,14; done
