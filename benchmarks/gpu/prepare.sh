#!/usr/bin/env bash
# Record the host and the tree a GPU run measures, check the host, and make the random checkpoints:
#   bash benchmarks/gpu/prepare.sh [PRESET ...]          e.g. 1.7b 0.6b
# Writes $OUT/setup.txt (date, commit, Python, torch and package versions, the GPU's name, driver and
# memory, gpu_check.py's figures) and $OUT/gpu_check.json. The commit comes from git, or from
# COMMIT=... where the checkout has no .git. Exit status 1 when a Triton kernel fails its check
# or the host is slower than gpu_check.py's bounds (the runs would not measure the build).
set -uo pipefail
source "$(dirname "$0")/common.sh"
S=$OUT/setup.txt
{
  date -u +"%Y-%m-%d %H:%M UTC"
  echo "commit ${COMMIT:-$(git log --oneline -1 2> /dev/null || echo unknown)}"
  $PY - << 'PY'
import importlib.metadata as metadata, sys, torch
names = ("numpy", "transformers", "tritonclient", "nvidia-pytriton")
versions = {n: metadata.version(n) for n in names if any(True for _ in metadata.distributions(name=n))}
print("python", sys.version.split()[0], sys.executable, "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU", versions)
PY
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} > "$S" 2>&1
$PY benchmarks/gpu_check.py --json "$OUT/gpu_check.json" >> "$S" 2>&1
status=$?
for preset in "$@"; do checkpoint "$preset" > /dev/null; done
cat "$S"
exit $status
