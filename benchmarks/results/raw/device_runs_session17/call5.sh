#!/usr/bin/env bash
# session 17, call 5 (same H200, 145 s; the command as sent): voxserve 0.6B again at 102 and 106.
source benchmarks/gpu/common.sh; D=20 W=0 T=170 bash benchmarks/gpu/run_serving.sh rates 0.6b voxserve 102,106 vx_06b_again > /dev/null 2>&1; grep "/s:" $OUT/log.txt | cut -c1-330
