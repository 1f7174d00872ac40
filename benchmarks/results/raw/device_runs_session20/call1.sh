#!/usr/bin/env bash
# session 20, call 1: GPU tests at 5271462 (max_draining after review), then voxserve 1.7B with
# --max-draining 768 (run_serving.sh) at 116, 120, 124 and 128 req/s, two probes per rate (seeds 0,
# 1), 20 s probes, no warm-up.
cd "$(dirname "$0")/.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > $S 2>&1
cat .carry/HEAD >> $S
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> $S; }
stamp start; checkpoint 1.7b > /dev/null 2>&1; stamp checkpoint
timeout 150 $PY -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py > $OUT/gpu_tests.txt 2>&1; stamp tests
export D=20 W=0
T=340 P='--repeats 2' bash benchmarks/gpu/run_serving.sh rates 1.7b voxserve 116,120,124,128 vx > /dev/null 2>&1; stamp voxserve
tail -3 $OUT/gpu_tests.txt; grep "rate " $OUT/log.txt | grep "/s" | cut -c1-330; tail -4 $S
cd $OUT && tar czf call1.tgz * --remove-files; ls -la $OUT
