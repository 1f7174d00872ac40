#!/usr/bin/env bash
# Install vLLM-Omni 0.26 (Qwen3-TTS serving) into a virtual environment that sees the host's torch.
#   bash install.sh [VENV]            (default VENV: ./vllm-omni-venv)
# The host has Python 3.12, a CUDA 13 driver and torch 2.11 (CUDA 13 build) installed system-wide;
# the venv inherits them (--system-site-packages), so pip does not download another torch.
# NO_DEPS=1: pip cannot resolve vllm's own requirements (an index without llguidance 1.7, say):
# install vllm and vllm-omni without dependencies, then the pins of requirements.txt.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=${1:-vllm-omni-venv}
PYTHON=${PYTHON:-python3.12}

"$PYTHON" -m venv --system-site-packages "$VENV"
PIP=("$VENV/bin/python" -m pip install --no-cache-dir)
"$VENV/bin/python" - <<'PY'
import sys, torch
assert sys.version_info[:2] == (3, 12), f"Python 3.12 expected, got {sys.version.split()[0]}"
assert torch.__version__.startswith("2.11"), f"torch 2.11 expected (vllm 0.26 pins it), got {torch.__version__}"
assert torch.cuda.is_available(), "no CUDA device visible"
print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
PY
if [ "${NO_DEPS:-0}" = 1 ]; then
  "${PIP[@]}" --no-deps vllm==0.26.0 vllm-omni==0.26.0
  "${PIP[@]}" --no-deps -r "$HERE/requirements.txt"
else
  # torch==2.11.0 from the host satisfies vllm's pin (a local label such as +cu130 is ignored).
  "${PIP[@]}" vllm==0.26.0 vllm-omni==0.26.0
fi
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version
import torch, vllm_omni  # noqa: F401 (the import is the check)
print(f"vllm {version('vllm')}, vllm-omni {version('vllm-omni')}, torch {torch.__version__}")
assert torch.__version__.startswith("2.11"), "pip replaced the host's torch: reinstall it, or use NO_DEPS=1"
PY
echo "installed into $VENV; next: bash $HERE/serve.sh CHECKPOINT"
