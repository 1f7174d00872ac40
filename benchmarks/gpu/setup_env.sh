#!/usr/bin/env bash
# Optional: prepare a GPU host that has torch but no network, from wheels and a Triton bundle copied
# onto it (any way you like):
#   WHEELS="DIR ..." TRITON_BUNDLE=FILE.tar.xz bash benchmarks/gpu/setup_env.sh
# - installs every wheel in each DIR into $PY's environment, without dependencies or an index (the
#   Triton runs need numpy 1.26, tritonclient and python-rapidjson; single_stream.py's peer needs
#   faster-qwen3-tts and its dependencies);
# - puts this checkout and client/ on that Python's path with a .pth file, as an editable install
#   would (Triton's Python backend stub ignores PYTHONPATH);
# - unpacks TRITON_BUNDLE (made by pack_triton.sh) into TRITON_DIR (/tmp/tri) and prints the
#   TRITONSERVER to export for run_serving.sh.
# Idempotent.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-python3}
for wheels in ${WHEELS:-}; do
  if compgen -G "$wheels/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$wheels"/*.whl
  else
    echo "no wheels in $wheels" >&2
  fi
done
SITE=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf '%s\n%s\n' "$ROOT" "$ROOT/client" > "$SITE/voxtriton-checkout.pth"
if [ -n "${TRITON_BUNDLE:-}" ]; then
  TRITON_DIR=${TRITON_DIR:-/tmp/tri}
  if [ ! -x "$TRITON_DIR/pytriton/tritonserver/bin/tritonserver" ]; then
    mkdir -p "$TRITON_DIR" && tar xJf "$TRITON_BUNDLE" -C "$TRITON_DIR"
  fi
  echo "export TRITONSERVER=$TRITON_DIR/pytriton/tritonserver/bin/tritonserver"
fi
$PY - << 'PY'
import importlib.metadata as metadata, sys, torch
names = ("numpy", "transformers", "tritonclient")
versions = {n: metadata.version(n) for n in names if any(True for _ in metadata.distributions(name=n))}
print("python", sys.version.split()[0], sys.executable, "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "", versions)
PY
