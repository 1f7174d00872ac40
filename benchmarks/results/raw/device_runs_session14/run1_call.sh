#!/usr/bin/env bash
# session 14, call 1 (x2): GPU tests + a sweep of voxserve's codec-lane levers, two chains, one per GPU
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup.txt 2>&1
nvidia-smi -L >> $OUT/setup.txt; nproc >> $OUT/setup.txt; git log --oneline -1 >> $OUT/setup.txt 2>&1
source benchmarks/gpu/common.sh
checkpoint 1.7b > /dev/null 2>&1
export D=20
S=benchmarks/gpu/run_serving.sh
DBL='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25'
(
  TRACE=1 T=120 bash $S rates 1.7b voxserve@0 90 trace90
  T=170 P="$DBL" bash $S rates 1.7b voxserve@0 88,92,96 vx_double
  T=170 P='--param tts:scheduler_max_batch=32' bash $S rates 1.7b voxserve@0 88,92,96 vx_mb32
) > /dev/null 2>&1 &
(
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py > /tmp/gpu_tests.txt 2>&1
  T=130 P="$DBL" bash $S rates 1.7b concurrent@1 74,76 cc_double
  T=130 P='--param tts:background_sms=0.85' bash $S rates 1.7b voxserve@1 88,92 vx_bg85
  T=130 P='--param tts:scheduler_slack_margin_s=0.5' bash $S rates 1.7b voxserve@1 88,92 vx_slack05
) > /dev/null 2>&1 &
wait
grep -h "/s:" $OUT/log.txt | cut -c1-260
cat /tmp/gpu_tests.txt >> $OUT/setup.txt; tail -3 /tmp/gpu_tests.txt
