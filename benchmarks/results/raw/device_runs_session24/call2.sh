#!/usr/bin/env bash
# session 24, call 2 (call 1 lacked tritonclient for make-checkpoint, and its GPU tests stopped at the codec graphs test, TF32 rounding): GPU tests (the snake kernel's zero tail, the dilated layers as dense conv2d,
# the last layer padded to 8 output channels); one graphed codec call per shape, cuDNN autotuned as
# the lanes run it, on 7d3085a (.base), d4ed773 (.mid: dilated layers as conv2d) and main (+ the
# padded last layer), then base again for drift; main's convolutions layer by layer.
cd "$(dirname "$0")/.." && source benchmarks/gpu/call_setup.sh 1.7b
timeout 150 $PY -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py > $OUT/gpu_tests.txt 2>&1; stamp tests
CS="--checkpoint /tmp/ck-1.7b --cudnn-benchmark --shapes 8x2,16x4,64x8,128x25,256x25"
PYTHONPATH=$PWD/.base timeout 80 $PY .base/benchmarks/codec_speed.py $CS --json $OUT/codec_base.json > $OUT/codec_base.txt 2>&1; stamp codec_base
PYTHONPATH=$PWD/.mid timeout 80 $PY .mid/benchmarks/codec_speed.py $CS --json $OUT/codec_mid.json > $OUT/codec_mid.txt 2>&1; stamp codec_mid
timeout 80 $PY benchmarks/codec_speed.py $CS --json $OUT/codec_main.json > $OUT/codec_main.txt 2>&1; stamp codec_main
PYTHONPATH=$PWD/.base timeout 80 $PY .base/benchmarks/codec_speed.py $CS --json $OUT/codec_base2.json > $OUT/codec_base2.txt 2>&1; stamp codec_base2
timeout 90 $PY benchmarks/codec_layers.py --checkpoint /tmp/ck-1.7b --cudnn-benchmark --shapes 16x4,256x25 --json $OUT/codec_layers.json > $OUT/codec_layers.txt 2>&1; stamp codec_layers
tail -3 $OUT/gpu_tests.txt; for f in codec_base codec_mid codec_main codec_base2; do echo "== $f"; grep -v "^ *$" $OUT/$f.txt | tail -7 | cut -c1-200; done
grep total $OUT/codec_layers.txt
finish call2
