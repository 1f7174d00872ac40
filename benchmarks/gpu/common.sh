# Sourced by the device-run scripts: paths, the interpreter, and `run` (echo, run, log to $OUT/log.txt).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=python3
export PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
cd "$ROOT"
run() { echo "+ $*" | tee -a "$LOG"; "$@" 2>&1 | grep -v "Warning\|warn(" | tee -a "$LOG"; }
# checkpoint PRESET: make the random checkpoint /tmp/ck-PRESET once, also when two runs ask at once.
checkpoint() {
  mkdir -p /tmp/locks
  ( flock 9; [ -f /tmp/ck-$1/speech_tokenizer/model.safetensors ] || run $PY -m voxtriton.cli make-checkpoint --preset $1 /tmp/ck-$1 ) 9>/tmp/locks/$1
}
