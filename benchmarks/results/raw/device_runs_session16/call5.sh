#!/usr/bin/env bash
# session 16, call 5 (same H200, 147 s; the command as sent): voxserve 0.6B again, lower rates.
source benchmarks/gpu/common.sh; D=20 W=0 T=170 bash benchmarks/gpu/run_serving.sh rates 0.6b voxserve 86,90 vx_06b_again > /dev/null 2>&1; grep "/s:" $OUT/log.txt | cut -c1-330; nvidia-smi --query-gpu=temperature.gpu,clocks.sm,memory.used --format=csv; ps aux | grep -c "tritonserver\|mps"
