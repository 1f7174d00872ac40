#!/usr/bin/env bash
# Prepare a device machine, which has no network: a venv over the image's packages (torch etc.) with
# the carried wheels (.whl/) on top and this checkout on its path, and, when carried, the trimmed
# Triton bundle (.carry/triton*.tar.xz, see pack_triton.sh). Idempotent: a warm machine reuses it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=/tmp/vt
if [ ! -x $VENV/bin/python ]; then
  python3 -m venv --system-site-packages $VENV
fi
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  $VENV/bin/python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$ROOT"/.whl/*.whl
fi
SITE=$($VENV/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf '%s\n%s\n' "$ROOT" "$ROOT/client" > "$SITE/voxtriton-checkout.pth"
if compgen -G "$ROOT/.carry/triton*.tar.xz" > /dev/null && [ ! -x /tmp/tri/pytriton/tritonserver/bin/tritonserver ]; then
  mkdir -p /tmp/tri && tar xJf "$ROOT"/.carry/triton*.tar.xz -C /tmp/tri
fi
$VENV/bin/python - <<'PY'
import numpy, torch, transformers
print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "", "numpy", numpy.__version__,
      "transformers", transformers.__version__)
PY
