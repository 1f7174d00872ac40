#!/usr/bin/env bash
# session 18, call 2 (same or fresh H200): the eager profile of call 1 again (its file did not come
# back), then both policies at 1.7B on main, two probes per rate, 20 s probes, no warm-up, one server
# after the other. Everything returns in one tgz.
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup2.txt 2>&1
source benchmarks/gpu/common.sh
checkpoint 1.7b > /dev/null 2>&1
timeout 90 $PY benchmarks/model_speed.py --preset 1.7b --checkpoint /tmp/ck-1.7b --device cuda --context 512 --batch-sizes 256 --repeat 3 --profile 40 > $OUT/profile_256.txt 2>&1
export D=20 W=0 T=250
S=benchmarks/gpu/run_serving.sh
P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25 --repeats 2' bash $S rates 1.7b concurrent 84,88 cc_rep > /dev/null 2>&1
P='--repeats 2' bash $S rates 1.7b voxserve 100,104 vx_rep > /dev/null 2>&1
grep "rate " $OUT/log.txt | grep "/s" | cut -c1-420
mkdir -p $OUT/c2 && mv $OUT/setup2.txt $OUT/profile_256.txt $OUT/log.txt $OUT/c2/ && mv $OUT/*.tgz $OUT/c2/ ; tar czf $OUT/call2.tgz -C $OUT c2 && rm -rf $OUT/c2
ls -la $OUT
