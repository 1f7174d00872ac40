#!/usr/bin/env bash
# session 17, call 1 (one H200, fresh machine): setup, the GPU tests (the admission and row-move
# graphs run on a GPU for the first time), then the engine thread's admission cost on main and on
# d3f471d (.base), 1.7B, graphs, alone and beside a Python thread at 5 and 1 ms switch intervals.
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup.txt 2>&1
nvidia-smi -L >> $OUT/setup.txt; git log --oneline -1 >> $OUT/setup.txt 2>&1
source benchmarks/gpu/common.sh
date +%T >> $OUT/setup.txt
checkpoint 1.7b > /dev/null 2>&1
date +%T >> $OUT/setup.txt
timeout 200 $PY -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py > $OUT/gpu_tests.txt 2>&1
date +%T >> $OUT/setup.txt
AC="--preset 1.7b --checkpoint /tmp/ck-1.7b --device cuda --graphs --switch-ms 5,1 --repeat 10"
timeout 90 $PY benchmarks/admission_cost.py $AC --json $OUT/ac_main.json > $OUT/ac.txt 2>&1
date +%T >> $OUT/setup.txt
PYTHONPATH=$PWD/.base timeout 90 $PY .base/benchmarks/admission_cost.py $AC --json $OUT/ac_base.json >> $OUT/ac.txt 2>&1
date +%T >> $OUT/setup.txt
tail -15 $OUT/gpu_tests.txt; grep -v Warn $OUT/ac.txt | tail -12; cat $OUT/setup.txt | tail -8
