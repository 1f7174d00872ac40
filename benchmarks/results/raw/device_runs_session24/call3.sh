#!/usr/bin/env bash
# session 24, call 3: GPU tests (the fused snake_pointwise kernel); one graphed codec call per shape,
# cuDNN autotuned as the lanes run it, on 7d3085a (.base), 7fcd057 (.mid: dilated layers as conv2d)
# and main (+ snake_pointwise); then voxserve 1.7B on main at 120 req/s, two probes (seeds 0, 1), 20 s,
# no warm-up, max_streams 512 (call 4 runs 7d3085a on the same machine).
cd "$(dirname "$0")/.." && source benchmarks/gpu/call_setup.sh 1.7b
timeout 150 $PY -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py > $OUT/gpu_tests.txt 2>&1; stamp tests
CS="--checkpoint /tmp/ck-1.7b --cudnn-benchmark --shapes 8x2,16x4,64x8,128x25,256x25"
PYTHONPATH=$PWD/.base timeout 80 $PY .base/benchmarks/codec_speed.py $CS --json $OUT/codec_base.json > $OUT/codec_base.txt 2>&1; stamp codec_base
PYTHONPATH=$PWD/.mid timeout 80 $PY .mid/benchmarks/codec_speed.py $CS --json $OUT/codec_mid.json > $OUT/codec_mid.txt 2>&1; stamp codec_mid
timeout 80 $PY benchmarks/codec_speed.py $CS --json $OUT/codec_main.json > $OUT/codec_main.txt 2>&1; stamp codec_main
T=170 P='--repeats 2' bash $R rates 1.7b voxserve 120 vx_main_120 > /dev/null 2>&1; stamp vx_main_120
tail -3 $OUT/gpu_tests.txt; for f in codec_base codec_mid codec_main; do echo "== $f"; grep -v "^ *$" $OUT/$f.txt | tail -4 | cut -c1-400; done
finish call3
