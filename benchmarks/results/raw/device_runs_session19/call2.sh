#!/usr/bin/env bash
# session 19, call 2: each codec convolution in NCW and channels-last layout (cuDNN autotuned), to
# price the NCW layout's transposes; model speed 1.7B with the predictor's new attention launch
# shape (16 keys, 2 warps, 2 stages) against 82fff95 (.base).
cd "$(dirname "$0")/.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > $S 2>&1
git log --oneline -1 >> $S 2>&1
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> $S; }
stamp start; checkpoint 1.7b > /dev/null 2>&1; stamp checkpoint
timeout 200 $PY benchmarks/codec_layers.py --checkpoint /tmp/ck-1.7b --cudnn-benchmark --channels-last --shapes 8x2,16x4,128x25,256x25 --json $OUT/codec_layers.json > $OUT/codec_layers.txt 2>&1; stamp codec_layers
MS="--preset 1.7b --checkpoint /tmp/ck-1.7b --device cuda --graphs --context 512"
timeout 120 $PY benchmarks/model_speed.py $MS --batch-sizes 16,128,256 --json $OUT/ms_main.json > $OUT/ms_main.txt 2>&1; stamp ms_main
PYTHONPATH=$PWD/.base timeout 120 $PY .base/benchmarks/model_speed.py $MS --batch-sizes 16,128,256 --json $OUT/ms_base.json > $OUT/ms_base.txt 2>&1; stamp ms_base
grep total_ms $OUT/codec_layers.txt; python3 -c "
import json; r = json.load(open('$OUT/codec_layers.json'))
for shape, v in r['shapes'].items():
    for l in v['layers']: print(shape, l['op'], l['x'], l['weight'], l['arguments'], l['count'], l['ms'], l.get('channels_last_ms'), l.get('channels_last_output'), round(l.get('channels_last_max_error', 0), 4))
" | cut -c1-200; tail -20 $OUT/codec_layers.txt | grep -i error | head -5
for f in ms_main ms_base; do echo "== $f"; grep "^|" $OUT/$f.txt; done; tail -6 $S
cd $OUT && tar czf call2.tgz * --remove-files; ls -la $OUT
