#!/usr/bin/env bash
# session 19, call 3: GPU tests (first GPU run of the snake kernel's hardware sine and the
# predictor's 2-warp launch); codec call time on main against 82fff95 (.base), cuDNN autotuned as
# the lanes run it; concurrent 1.7B at 80 and 84 req/s, two probes each (seeds 0, 1), 20 s probes,
# no warm-up.
cd "$(dirname "$0")/.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > $S 2>&1
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> $S; }
stamp start; checkpoint 1.7b > /dev/null 2>&1; stamp checkpoint
timeout 150 $PY -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py > $OUT/gpu_tests.txt 2>&1; stamp tests
CS="--checkpoint /tmp/ck-1.7b --cudnn-benchmark --shapes 8x2,64x8,128x25,256x25"
timeout 80 $PY benchmarks/codec_speed.py $CS --json $OUT/codec_main.json > $OUT/codec_main.txt 2>&1; stamp codec_main
PYTHONPATH=$PWD/.base timeout 80 $PY .base/benchmarks/codec_speed.py $CS --json $OUT/codec_base.json > $OUT/codec_base.txt 2>&1; stamp codec_base
tail -3 $OUT/gpu_tests.txt; for f in codec_main codec_base; do echo "== $f"; grep -v "^ *$" $OUT/$f.txt | tail -6 | cut -c1-300; done
export D=20 W=0 T=250
P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25 --repeats 2' bash benchmarks/gpu/run_serving.sh rates 1.7b concurrent 80,84 cc > /dev/null 2>&1; stamp concurrent
grep "rate " $OUT/log.txt | grep "/s" | cut -c1-330; tail -7 $S
cd $OUT && tar czf call3.tgz * --remove-files; ls -la $OUT
