#!/usr/bin/env bash
# Prepare a device machine, which has no network and is given back bare after the session: install
# the carried wheels (.whl/) into the image's own Python (the one that holds torch), put this
# checkout on its path with a .pth file (Triton's Python stub ignores PYTHONPATH), and unpack the
# trimmed Triton bundle when carried (.carry/triton*.tar.xz, made by pack_triton.sh). Idempotent.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=python3
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$ROOT"/.whl/*.whl
fi
SITE=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf '%s\n%s\n' "$ROOT" "$ROOT/client" > "$SITE/voxtriton-checkout.pth"
if compgen -G "$ROOT/.carry/triton*.tar.xz" > /dev/null && [ ! -x /tmp/tri/pytriton/tritonserver/bin/tritonserver ]; then
  mkdir -p /tmp/tri && tar xJf "$ROOT"/.carry/triton*.tar.xz -C /tmp/tri
fi
$PY - <<'PY'
import sys, numpy, torch, transformers
print("python", sys.version.split()[0], sys.executable, "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "", "numpy", numpy.__version__,
      "transformers", transformers.__version__)
PY
