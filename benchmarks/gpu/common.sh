# Sourced by the device-run scripts: paths, the interpreter, and `run` (echo, run, log to $OUT/log.txt).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=python3
export PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
cd "$ROOT"
run() { echo "+ $*" | tee -a "$LOG"; "$@" 2>&1 | grep -v "Warning\|warn(" | tee -a "$LOG"; }
