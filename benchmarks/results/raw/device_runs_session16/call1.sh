#!/usr/bin/env bash
# session 16, call 1 (one H200, fresh machine): voxserve's first load with no warm-up (empty Triton
# cache), then the GPU tests, then model speed of main against 61c8223 (before the fused norm kernels).
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup.txt 2>&1
nvidia-smi -L >> $OUT/setup.txt; git log --oneline -1 >> $OUT/setup.txt 2>&1
ls ~/.triton/cache 2>/dev/null | wc -l >> $OUT/setup.txt
source benchmarks/gpu/common.sh
checkpoint 1.7b > /dev/null 2>&1
date +%T >> $OUT/setup.txt
W=0 D=20 T=200 bash benchmarks/gpu/run_serving.sh rates 1.7b voxserve 96,100,104 vx_first > /dev/null 2>&1
date +%T >> $OUT/setup.txt
find ~/.triton/cache -name '*.json' ! -name '__grp*' -printf '%TT %f\n' 2>/dev/null | sort > $OUT/triton_cache.txt
timeout 170 $PY -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py > $OUT/gpu_tests.txt 2>&1
date +%T >> $OUT/setup.txt
MS="--preset 1.7b --checkpoint /tmp/ck-1.7b --device cuda --graphs --batch-sizes 16,128,256 --context 512"
timeout 75 $PY benchmarks/model_speed.py $MS --json $OUT/ms_main.json > $OUT/ms.txt 2>&1
PYTHONPATH=$PWD/.base timeout 75 $PY .base/benchmarks/model_speed.py $MS --json $OUT/ms_base.json >> $OUT/ms.txt 2>&1
date +%T >> $OUT/setup.txt
grep "rate\|warm-up" $OUT/log.txt | grep "/s:" | cut -c1-330
tail -3 $OUT/gpu_tests.txt; grep "^batch" $OUT/ms.txt; cat $OUT/setup.txt | tail -6
