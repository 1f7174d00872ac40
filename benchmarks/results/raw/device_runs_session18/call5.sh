#!/usr/bin/env bash
# session 18, call 5: concurrent 1.7B at 72 and 76 (seeds 0, 1), then voxserve at 96 and 100 with new
# arrivals (seeds 2, 3); 20 s probes, no warm-up, one server after the other.
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup5.txt 2>&1
source benchmarks/gpu/common.sh
checkpoint 1.7b > /dev/null 2>&1
export D=20 W=0 T=195
S=benchmarks/gpu/run_serving.sh
P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25 --repeats 2' bash $S rates 1.7b concurrent 72,76 cc_rep_72 > /dev/null 2>&1
P='--seed 2 --repeats 2' bash $S rates 1.7b voxserve 96,100 vx_rep_seed2 > /dev/null 2>&1
grep "rate " $OUT/log.txt | grep "/s" | cut -c1-330
mv $OUT/log.txt $OUT/setup5.txt /tmp/ 2>/dev/null; tar czf $OUT/call5.tgz -C /tmp log.txt setup5.txt -C $OUT $(cd $OUT && ls *.tgz) && rm -f $OUT/cc_rep_72.tgz $OUT/vx_rep_seed2.tgz; ls -la $OUT
