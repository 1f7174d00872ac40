# Sourced by the GPU run scripts: the repository root, the interpreter, the output folder, `run`
# (echo a command, run it, log it to $OUT/log.txt) and `checkpoint PRESET`.
#   PY: the Python that has torch and voxtriton (python3); OUT: where runs write
#   (/tmp/voxtriton-gpu-runs); CKPTS: where random checkpoints are made (/tmp).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PY:-python3}
OUT=${OUT:-/tmp/voxtriton-gpu-runs}
CKPTS=${CKPTS:-/tmp}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
cd "$ROOT"
run() { echo "+ $*" | tee -a "$LOG"; "$@" 2>&1 | grep -v "Warning\|warn(" | tee -a "$LOG"; }
# checkpoint PRESET: make the random-weight checkpoint $CKPTS/ck-PRESET once, also when two runs ask at once.
checkpoint() {
  mkdir -p "$CKPTS/locks"
  (
    flock 9
    last=speech_tokenizer/model.safetensors  # the file make-checkpoint writes last
    case $1 in csm-*) last=model.safetensors ;; esac
    # make-checkpoint writes into a new or empty directory: one left half-written starts over
    [ -f "$CKPTS/ck-$1/$last" ] || { rm -rf "$CKPTS/ck-$1" && run $PY -m voxtriton.cli make-checkpoint --preset "$1" "$CKPTS/ck-$1"; }
  ) 9> "$CKPTS/locks/$1"
}
