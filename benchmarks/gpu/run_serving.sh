#!/usr/bin/env bash
# Device runs of the full Triton server (MPS, green contexts, BLS, codec state pool).
#   run_serving.sh lanes   PRESET                                  closed loop, 1-128 streams, every policy
#   run_serving.sh single  PRESET                                  one stream at a time: TTFA and RTF per policy
#   run_serving.sh goodput PRESET POLICIES LOW HIGH STEPS NAME     goodput bisection (POLICY*N: N servers, one per GPU)
#   run_serving.sh rates   PRESET POLICIES RATES NAME              open loop at fixed rates (e.g. 20,26,32)
# To run on one GPU of several (two measurements side by side), pin the policy: POLICY@G (e.g.
# concurrent@1). The launcher now also renumbers CUDA_VISIBLE_DEVICES for MPS clients, but that path
# has not run on a GPU yet: with CUDA_VISIBLE_DEVICES=1 before the fix, every model fell back to the CPU.
# Results go to $OUT/NAME.tgz (results.json, results.md, plots, server logs: one file, as $OUT returns
# only a few); every probe's summary line also goes to $OUT/log.txt. T: time limit in seconds (540:
# a run cut short needs up to about a minute to stop its servers, inside a 600 s device call);
# D: seconds of arrivals per open-loop probe (30); P: more serving_bench arguments, e.g.
# P='--param tts:background_sms=48'. W: seconds of warm-up load at the lowest rate, not counted (10).
# ROWS: max_streams, the KV-cache rows (512); frame-step graphs are captured up to 768 rows, capped
# at ROWS by the server.
# TRACE=1 (one policy, one server): the server writes a chunk
# trace, and the tgz gets its report (trace_report.json, chunk_trace_report.py with 5 s windows)
# instead of the trace itself. The report covers the warm-up and every rate of the run, in time order.
set -uo pipefail
source "$(dirname "$0")/common.sh"
MODE=$1 PRESET=${2:-1.7b}
CK=/tmp/ck-$PRESET
TRACE_FILE=/tmp/trace_$$.jsonl
if [ -n "${TRACE:-}" ]; then
  # One server's trace: servers of several policies or GPUs would append to one file.
  case "$MODE ${3:-}" in rates\ *,*|rates\ *\**|goodput\ *,*|goodput\ *\**|lanes*|single*)
    echo "TRACE=1 takes one policy on one server (rates or goodput), not '$MODE ${3:-}'" >&2; exit 2 ;; esac
  P="${P:-} --param tts:chunk_trace_path=$TRACE_FILE"
fi
checkpoint $PRESET
COMMON="--checkpoint $CK --tritonserver /tmp/tri/pytriton/tritonserver/bin/tritonserver --keep-logs --warm-up-load ${W:-10}
  --param tts:max_positions=512 --max-streams ${ROWS:-512} --max-queued 256 --max-draining 768
  --param tts:graph_batch_sizes=1,2,4,8,16,32,48,64,96,128,192,256,384,512,640,768 ${P:-}"
case "$MODE" in
  lanes)
    NAME=lanes_$PRESET
    run timeout ${T:-540} $PY benchmarks/serving_bench.py $COMMON --policies voxserve,concurrent,serial \
      --concurrency 1,8,32,128 --duration 12 --out $OUT/$NAME ;;
  single)
    NAME=single_$PRESET
    run timeout ${T:-540} $PY benchmarks/serving_bench.py $COMMON --policies voxserve,concurrent,serial \
      --concurrency 1 --duration 20 --out $OUT/$NAME ;;
  goodput)
    NAME=$7
    run timeout ${T:-540} $PY benchmarks/serving_bench.py $COMMON --policies "$3" --goodput --rate-low $4 \
      --rate-high $5 --bisection-steps $6 --duration ${D:-30} --out $OUT/$NAME ;;
  rates)
    NAME=$5
    run timeout ${T:-540} $PY benchmarks/serving_bench.py $COMMON --policies "$3" --rates $4 \
      --duration ${D:-30} --out $OUT/$NAME ;;
esac
if [ -n "${TRACE:-}" ] && [ -f $TRACE_FILE ] && [ -d $OUT/$NAME ]; then
  $PY benchmarks/chunk_trace_report.py $TRACE_FILE --window 5 > $OUT/$NAME/trace_report.json && rm -f $TRACE_FILE
fi
[ -d $OUT/$NAME ] && tar czf $OUT/$NAME.tgz -C $OUT $NAME && rm -rf $OUT/$NAME
