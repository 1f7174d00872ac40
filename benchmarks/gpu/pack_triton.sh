#!/usr/bin/env bash
# Optional, for a GPU host without network: trim the nvidia-pytriton 0.7.0 wheel to what one Python
# version's server needs (the tritonserver binary, its libraries, the Python backend and one stub),
# 55 MB -> about 25 MB, for setup_env.sh's TRITON_BUNDLE. Run where pip can download:
#   bash benchmarks/gpu/pack_triton.sh 3.12 triton-3.12.tar.xz
set -euo pipefail
VERSION=$1 OUT=$2
WORK=$(mktemp -d)
python3 -m pip download -q --no-deps nvidia-pytriton==0.7.0 -d "$WORK"
(cd "$WORK" && unzip -q nvidia_pytriton-*.whl 'pytriton/tritonserver/*' 'nvidia_pytriton.libs/*')
for stub in "$WORK"/pytriton/tritonserver/python_backend_stubs/*; do
  [ "$(basename "$stub")" = "$VERSION" ] || rm -rf "$stub"
done
rm -f "$WORK"/nvidia_pytriton.libs/libpython3-*  # only the 3.13 stub links it
tar cf - -C "$WORK" pytriton nvidia_pytriton.libs | xz -T0 -9e > "$OUT"
rm -rf "$WORK"
ls -la "$OUT"
