#!/usr/bin/env bash
# session 14, call 3 (x2): 1.7B concurrent's limit and voxserve's confirmation; 0.6B both policies
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup.txt 2>&1
nvidia-smi -L >> $OUT/setup.txt
source benchmarks/gpu/common.sh
checkpoint 1.7b > /dev/null 2>&1; checkpoint 0.6b > /dev/null 2>&1
export D=20 T=215
S=benchmarks/gpu/run_serving.sh
DBL='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25'
(
  P="$DBL" bash $S rates 1.7b concurrent@0 80,82,84 cc_17b
  bash $S rates 0.6b voxserve@0 98,102,106 vx_06b
) > /dev/null 2>&1 &
(
  bash $S rates 1.7b voxserve@1 96,98,100 vx_17b
  P="$DBL" bash $S rates 0.6b concurrent@1 80,84,88 cc_06b
) > /dev/null 2>&1 &
wait
for d in $OUT/*.tgz; do echo "== $d"; tar xzf $d -O --wildcards '*/results.md' | grep "^| [a-z]" | grep -v "^| policy" | cut -d'|' -f2-12,14; done
grep -h "warm-up" $OUT/log.txt | grep "/s:" | cut -c1-200
