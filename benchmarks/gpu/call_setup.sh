# Sourced by a device call's script (kept under benchmarks/results/raw/device_runs_session*/):
#   source benchmarks/gpu/call_setup.sh PRESET...
# prepares the machine (setup_env.sh), records the tree's `git log --oneline -1` (written to
# .carry/HEAD before the call, as the device gets the working tree without .git), the machine's
# speed (benchmarks/gpu_check.py, also in $OUT/gpu_check.json) and the time each step ended in
# $OUT/setup.txt, makes the random checkpoints, and leaves `stamp NOTE` (a timed line
# in setup.txt), `finish NAME` (print the probes' summary lines, pack $OUT into NAME.tgz) and
# R (run_serving.sh) for the script's runs. Runs get D=20 s probes and no warm-up load unless the
# caller set D or W. Name no variable CC: the device image exports it (Triton's C compiler).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
S=$OUT/setup.txt
bash benchmarks/gpu/setup_env.sh > "$S" 2>&1
cat .carry/HEAD >> "$S" 2>/dev/null || echo "no .carry/HEAD: the tree is not recorded" >> "$S"
source benchmarks/gpu/common.sh
stamp() { echo "$(date +%T) $*" >> "$S"; }
stamp start
$PY benchmarks/gpu_check.py --json "$OUT/gpu_check.json" >> "$S" 2>&1 || stamp "gpu_check: a kernel failed its check, the machine is slower than a bound, or no GPU (see above)"
for preset in "$@"; do checkpoint "$preset" > /dev/null 2>&1; stamp "checkpoint $preset"; done
export D=${D:-20} W=${W:-0}
R=benchmarks/gpu/run_serving.sh
finish() {
  grep "rate " "$OUT/log.txt" | grep "/s" | cut -c1-330
  tail -n 12 "$S"
  (cd "$OUT" && tar czf "$1.tgz" --remove-files -- * && ls -la)
}
