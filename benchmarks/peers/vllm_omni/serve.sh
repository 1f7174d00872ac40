#!/usr/bin/env bash
# Serve a Qwen3-TTS checkpoint with vLLM-Omni (installed by install.sh) and wait until it answers.
#   bash serve.sh CHECKPOINT [PORT]     (PORT default 8091)
# Settings, from the environment (defaults: its best settings to try first):
#   VENV (./vllm-omni-venv)  INITIAL (8: frames of the first audio chunk)  RAMP (unset; e.g.
#   4,4,8,16,25: sizes of the first chunks, overriding INITIAL)  SEQS (256: streams each stage
#   batches)  CODEC_SEQS (unset: as SEQS)  GPU_MEM (0.45: memory share of each of the two stages)
#   REPLICAS (1: copies of both stages, one per GPU, GPUs 0..REPLICAS-1 of those visible; the server
#   deals requests to them in turn)
#   LOG (/tmp/vllm-omni-PORT.log)  READY_TIMEOUT (900 s: two stages and their CUDA graphs)
# The server runs in the background and outlives this script; stop it with: kill -- -$(cat $LOG.pid)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CK=$(realpath "$1") PORT=${2:-8091}
VENV=${VENV:-vllm-omni-venv} LOG=${LOG:-/tmp/vllm-omni-$PORT.log}
DEPLOY=${LOG%.log}.deploy.yaml

# Offline: the checkpoint is a local directory (random weights in the official layout).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Sample with PyTorch where flashinfer is not installed (NO_DEPS installs leave it out).
"$VENV/bin/python" -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0

"$VENV/bin/python" "$HERE/tune_deploy.py" "$DEPLOY" --initial-chunk "${INITIAL:-8}" \
  ${RAMP:+--ramp "$RAMP"} --max-num-seqs "${SEQS:-256}" ${CODEC_SEQS:+--codec-max-num-seqs "$CODEC_SEQS"} \
  --gpu-memory "${GPU_MEM:-0.45}" --replicas "${REPLICAS:-1}"

# The CLI's entry point, called by module: the same whether or not pip installed a console script.
setsid "$VENV/bin/python" -c \
  'import sys; from vllm_omni.entrypoints.cli.main import main; sys.argv[0] = "vllm-omni"; sys.exit(main())' \
  serve "$CK" --omni --trust-remote-code --port "$PORT" --deploy-config "$DEPLOY" \
  --stage-init-timeout "${READY_TIMEOUT:-900}" > "$LOG" 2>&1 < /dev/null &
echo $! > "$LOG.pid"
echo "vLLM-Omni starting (pid $(cat "$LOG.pid"), log $LOG, deploy config $DEPLOY)"
for ((waited = 0; waited < ${READY_TIMEOUT:-900}; waited += 2)); do
  if curl -sf -o /dev/null "http://127.0.0.1:$PORT/v1/models"; then
    echo "ready after ${waited} s: http://127.0.0.1:$PORT (model name: $CK)"
    exit 0
  fi
  kill -0 "$(cat "$LOG.pid")" 2>/dev/null || { echo "server exited; the end of $LOG:"; tail -40 "$LOG"; exit 1; }
  sleep 2
done
echo "not ready after ${READY_TIMEOUT:-900} s; see $LOG"; exit 1
