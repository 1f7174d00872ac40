#!/usr/bin/env bash
# Prepare a device machine, which has no network and is given back bare after the session: install
# the carried wheels (.whl/ for the peer benchmark, .whl-serving/ for the Triton runs: numpy 1.26,
# tritonclient, python-rapidjson) into the image's own Python (the one that holds torch), put this
# checkout on its path with a .pth file (Triton's Python stub ignores PYTHONPATH), and unpack the
# trimmed Triton bundle when carried (.carry/triton*.tar.xz, made by pack_triton.sh). Idempotent.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=python3
for wheels in "$ROOT/.whl" "$ROOT/.whl-serving"; do
  if compgen -G "$wheels/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$wheels"/*.whl
  fi
done
SITE=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf '%s\n%s\n' "$ROOT" "$ROOT/client" > "$SITE/voxtriton-checkout.pth"
if compgen -G "$ROOT/.carry/triton*.tar.xz" > /dev/null && [ ! -x /tmp/tri/pytriton/tritonserver/bin/tritonserver ]; then
  mkdir -p /tmp/tri && tar xJf "$ROOT"/.carry/triton*.tar.xz -C /tmp/tri
fi
$PY - <<'PY'
import importlib.metadata as metadata, sys, torch
versions = {name: metadata.version(name) for name in ("numpy", "transformers", "tritonclient")
            if any(True for _ in metadata.distributions(name=name))}
print("python", sys.version.split()[0], sys.executable, "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "", versions)
PY
