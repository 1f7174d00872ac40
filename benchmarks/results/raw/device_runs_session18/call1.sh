#!/usr/bin/env bash
# session 18, call 1 (one H200, fresh machine): setup; the GPU tests (per-lane codec graphs, the
# per-policy state pool and the rotary tables run on a GPU for the first time); model speed 1.7B on
# main against d3f471d (.base, before the rotary tables); batch 384/512 on main; an eager profile of
# the frame step and a codec call at batch 256; model speed 0.6B on main.
cd "$(dirname "$0")/.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > $S 2>&1
nvidia-smi -L >> $S; git log --oneline -1 >> $S 2>&1
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> $S; }
stamp start; checkpoint 1.7b > /dev/null 2>&1; stamp checkpoint
timeout 240 $PY -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py > $OUT/gpu_tests.txt 2>&1; stamp tests
MS="--preset 1.7b --checkpoint /tmp/ck-1.7b --device cuda --graphs --context 512"
timeout 120 $PY benchmarks/model_speed.py $MS --batch-sizes 16,128,256 --json $OUT/ms_main.json > $OUT/ms_main.txt 2>&1; stamp ms_main
PYTHONPATH=$PWD/.base timeout 120 $PY .base/benchmarks/model_speed.py $MS --batch-sizes 16,128,256 --json $OUT/ms_base.json > $OUT/ms_base.txt 2>&1; stamp ms_base
timeout 120 $PY benchmarks/model_speed.py $MS --batch-sizes 384,512 --chunk-frames 4 --json $OUT/ms_main_large.json > $OUT/ms_main_large.txt 2>&1; stamp ms_large
timeout 120 $PY benchmarks/model_speed.py --preset 1.7b --checkpoint /tmp/ck-1.7b --device cuda --context 512 --batch-sizes 256 --repeat 3 --profile 40 > $OUT/profile_256.txt 2>&1; stamp profile
checkpoint 0.6b > /dev/null 2>&1; stamp checkpoint_06
timeout 120 $PY benchmarks/model_speed.py --preset 0.6b --checkpoint /tmp/ck-0.6b --device cuda --graphs --context 512 --batch-sizes 16,128,256 --json $OUT/ms_06b.json > $OUT/ms_06b.txt 2>&1; stamp ms_06b
tail -4 $OUT/gpu_tests.txt; for f in ms_main ms_base ms_main_large ms_06b; do echo "== $f"; grep "^|" $OUT/$f.txt; done; cat $S | tail -12
