#!/usr/bin/env bash
# compute-sanitizer over the GPU test programs: each tool over each program, on its reduced set
# (QEVICT_GPU_QUICK=1) where the program has one. One line a run in $OUT/sanitize.txt: the
# program's cases and the tool's summary; each run's whole log beside it.
#   BIN:      folder of the built test programs (default: build/release/tests, as scripts/test.sh builds them)
#   PROGRAMS: which programs (default: the four GPU test programs that launch kernels;
#             test_decode_layout checks the kernels' byte plan on the host and makes no CUDA call)
#   TOOLS:    which tools (default: memcheck racecheck initcheck synccheck)
#   LIMIT:    seconds a run may take (default 300)
#   JOBS:     with JOBS > 1, each test case of a program runs under the tool as a process of its
#             own, JOBS of them at once (default 1: the whole program in one process). The
#             processes share the GPU; the host backend's reference runs beside them on the CPU's
#             cores. A tool over a program then gets a line a case, then one for the program.
# Exits 1 if a run reports an error or a failed case (or a program is missing); else 2 if a run
# reached its limit, found no GPU or made no CUDA call (the tool then checked nothing); else 0.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
bin="${BIN:-build/release/tests}"
programs="${PROGRAMS:-test_decode_attention test_cuda_backend test_cuda_policies test_cuda_presets}"
tools="${TOOLS:-memcheck racecheck initcheck synccheck}"
limit="${LIMIT:-300}"
jobs="${JOBS:-1}"
sum="$out/sanitize.txt"
if ! command -v compute-sanitizer > /dev/null; then
  echo "compute-sanitizer is not on PATH (the CUDA toolkit installs it, e.g. in /usr/local/cuda/bin)" >&2
  exit 1
fi
if ! [[ "$jobs" =~ ^[1-9][0-9]*$ ]]; then
  echo "JOBS must be a positive whole number, not '$jobs'" >&2
  exit 1
fi
: > "$sum"
export QEVICT_GPU_QUICK=1
status=0

# Outcomes in order of weight: failed (1) > inconclusive (2) > clean (0). The heavier of two:
heavier() {
  if [ "$1" -eq 1 ] || [ "$2" -eq 1 ]; then echo 1; elif [ "$1" -eq 2 ] || [ "$2" -eq 2 ]; then echo 2; else echo 0; fi
}

# The verdict on one run from its exit status and log, and its outcome.
verdict_of() {
  local rc=$1 log=$2
  # compute-sanitizer exits 255 when the program ends before its first CUDA call: if the
  # program itself passed, the tool had nothing to check.
  if [ "$rc" -eq 255 ] && grep -q "terminated before first instrumented API call" "$log" && grep -q "Status: SUCCESS" "$log"; then
    rc=nothing
  fi
  case $rc in
    0) verdict="clean"; outcome=0 ;;
    nothing) verdict="nothing to check: the program passed without a CUDA call"; outcome=2 ;;
    9) verdict="ERRORS"; outcome=1 ;;
    124) verdict="reached the ${limit} s limit: inconclusive"; outcome=2 ;;
    77) verdict="skipped: the program found no CUDA device"; outcome=2 ;;
    *) verdict="FAILED (exit $rc)"; outcome=1 ;;
  esac
}

# "tool program: verdict (seconds) | cases | the tool's summary", from the run's log.
report() {
  local label=$1 log=$2 seconds=$3 cases summary
  cases=$(grep -h 'test cases:' "$log" | tr -s ' ')
  summary=$(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1 | sed 's/^=* *//')
  echo "$label: $verdict ($seconds s) ${cases:+| $cases }${summary:+| $summary}" | tee -a "$sum"
}

# The tool over the program (its filter and the arguments given) into the log; its exit status.
run_tool() {
  local log=$1; shift
  timeout -k 10 "$limit" compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin/$prog" "$@" "${filter[@]}" > "$log" 2>&1
}

# The program's test case names (after the filter), one a line; none where it lists none (no GPU).
list_cases() {
  "$bin/$1" --list-test-cases "${filter[@]}" 2> /dev/null | sed -n '/^=====/,/^=====/p' | sed '1d;$d'
}

for prog in $programs; do
  if ! [ -x "$bin/$prog" ]; then echo "$prog: not found in $bin" | tee -a "$sum"; status=1; continue; fi
  # This case makes a cudaMalloc fail on purpose and checks the free memory after it: under a
  # sanitizer both the reported API error and the sanitizer's own allocations are expected.
  filter=()
  [ "$prog" = test_cuda_backend ] && filter=(-tce="*runs out of device memory*")
  cases=()
  [ "$jobs" -gt 1 ] && mapfile -t cases < <(list_cases "$prog")
  for tool in $tools; do
    t0=$(date +%s)
    if [ ${#cases[@]} -le 1 ]; then
      log="$out/${tool}_$prog.log"
      run_tool "$log"
      verdict_of $? "$log"
      status=$(heavier $status $outcome)
      report "$tool $prog" "$log" $(( $(date +%s) - t0 ))
      continue
    fi
    # One process a case. A comma separates doctest's filters, so it is matched by '?' here.
    for i in "${!cases[@]}"; do
      while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
      log="$out/${tool}_${prog}_case$((i + 1)).log"
      ( s=$(date +%s)
        run_tool "$log" -tc="${cases[$i]//,/?}"
        echo "$? $(( $(date +%s) - s ))" > "$log.rc" ) &
    done
    wait
    heaviest=0
    for i in "${!cases[@]}"; do
      log="$out/${tool}_${prog}_case$((i + 1)).log"
      read -r rc seconds < "$log.rc" && rm -f "$log.rc"
      verdict_of "$rc" "$log"
      # A case's filter that matched no case ran nothing: that is no check.
      if grep -q 'test cases: 0 ' "$log" && [ $outcome -eq 0 ]; then
        verdict="FAILED (the filter matched no test case)"; outcome=1
      fi
      status=$(heavier $status $outcome)
      heaviest=$(heavier $heaviest $outcome)
      report "  $tool $prog [case $((i + 1))/${#cases[@]}: ${cases[$i]}]" "$log" "$seconds"
    done
    case $heaviest in
      0) verdict="clean in every case" ;;
      1) verdict="ERRORS or FAILED in a case (above)" ;;
      *) verdict="inconclusive in a case (above)" ;;
    esac
    echo "$tool $prog: $verdict (${#cases[@]} cases, $jobs at once, $(( $(date +%s) - t0 )) s)" | tee -a "$sum"
  done
done
exit $status
