#!/usr/bin/env bash
# serve: CUDA MPS + tritonserver with the voxtriton repository, listening on all interfaces (inside
# the container; publish ports to choose who can reach it). gateway: the OpenAI-compatible HTTP front.
set -euo pipefail
CHECKPOINT=${VOXTRITON_CHECKPOINT:-/models/checkpoint}
case "${1:-serve}" in
  serve)
    shift || true
    args=(--host 0.0.0.0 --model-repository /opt/voxtriton/src/model_repository)
    if [ -d "$CHECKPOINT" ]; then
      args+=(--checkpoint "$CHECKPOINT")
    else
      echo "voxtriton: no checkpoint at $CHECKPOINT: serving the tiny RANDOM-weight default (noise)" >&2
    fi
    exec voxtriton serve "${args[@]}" "$@" ;;
  gateway)
    shift
    exec voxtriton gateway --host 0.0.0.0 "$@" ;;
  *)
    exec "$@" ;;
esac
