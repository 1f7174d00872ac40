#!/usr/bin/env bash
# session 18, call 4: both policies at 1.7B one step below call 2's rates, two probes per rate
# (seeds 0 and 1), 20 s probes, no warm-up, one server after the other.
cd "$(dirname "$0")/.."
bash benchmarks/gpu/setup_env.sh > $OUT/setup4.txt 2>&1
source benchmarks/gpu/common.sh
checkpoint 1.7b > /dev/null 2>&1
export D=20 W=0 T=240
S=benchmarks/gpu/run_serving.sh
P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25 --repeats 2' bash $S rates 1.7b concurrent 76,80 cc_rep_low > /dev/null 2>&1
P='--repeats 2' bash $S rates 1.7b voxserve 92,96 vx_rep_low > /dev/null 2>&1
grep "rate " $OUT/log.txt | grep "/s" | cut -c1-330
mv $OUT/log.txt $OUT/setup4.txt /tmp/ 2>/dev/null; tar czf $OUT/call4.tgz -C /tmp log.txt setup4.txt -C $OUT cc_rep_low.tgz vx_rep_low.tgz && rm -f $OUT/cc_rep_low.tgz $OUT/vx_rep_low.tgz; ls -la $OUT
