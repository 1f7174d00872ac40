#!/usr/bin/env bash
# session 19, call 1 (one H200, fresh machine): setup; the GPU tests (first GPU run of decode
# attention's span-dependent launch shape); attention_speed.py (every launch shape on every case);
# model speed 1.7B on main against 82fff95 (.base, before the new shape); an eager profile at batch 256.
cd "$(dirname "$0")/.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > $S 2>&1
nvidia-smi -L >> $S; git log --oneline -1 >> $S 2>&1
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> $S; }
stamp start; checkpoint 1.7b > /dev/null 2>&1; stamp checkpoint
timeout 240 $PY -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py > $OUT/gpu_tests.txt 2>&1; stamp tests
timeout 150 $PY benchmarks/attention_speed.py --json $OUT/attention_speed.json > $OUT/attention_speed.txt 2>&1; stamp attention
MS="--preset 1.7b --checkpoint /tmp/ck-1.7b --device cuda --graphs --context 512"
timeout 120 $PY benchmarks/model_speed.py $MS --batch-sizes 16,128,256 --json $OUT/ms_main.json > $OUT/ms_main.txt 2>&1; stamp ms_main
PYTHONPATH=$PWD/.base timeout 120 $PY .base/benchmarks/model_speed.py $MS --batch-sizes 16,128,256 --json $OUT/ms_base.json > $OUT/ms_base.txt 2>&1; stamp ms_base
timeout 100 $PY benchmarks/model_speed.py --preset 1.7b --checkpoint /tmp/ck-1.7b --device cuda --context 512 --batch-sizes 256 --repeat 3 --profile 40 > $OUT/profile_256.txt 2>&1; stamp profile
tail -4 $OUT/gpu_tests.txt; grep -v "^ *$" $OUT/attention_speed.txt | tail -60 | cut -c1-200
for f in ms_main ms_base; do echo "== $f"; grep "^|" $OUT/$f.txt; done; grep -i "attention\|Self CUDA time total" $OUT/profile_256.txt | head -8 | cut -c1-200; tail -9 $S
cd $OUT && tar czf call1.tgz * --remove-files; ls -la $OUT
