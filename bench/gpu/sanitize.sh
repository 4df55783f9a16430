#!/usr/bin/env bash
# compute-sanitizer over the GPU test programs: each tool over each program, on its reduced set
# (QEVICT_GPU_QUICK=1) where the program has one. One line a run in $OUT/sanitize.txt: the
# program's cases and the tool's summary; each run's whole log beside it.
#   BIN:      folder of the built test programs (default: build/release/tests, as scripts/test.sh builds them)
#   PROGRAMS: which programs (default: the four GPU test programs that launch kernels;
#             test_decode_layout checks the kernels' byte plan on the host and makes no CUDA call)
#   TOOLS:    which tools (default: memcheck racecheck initcheck synccheck)
#   LIMIT:    seconds a run may take (default 300)
# Exits 1 if a run reports an error or a failed case (or a program is missing); else 2 if a run
# reached its limit, found no GPU or made no CUDA call (the tool then checked nothing); else 0.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
bin="${BIN:-build/release/tests}"
programs="${PROGRAMS:-test_decode_attention test_cuda_backend test_cuda_policies test_cuda_presets}"
tools="${TOOLS:-memcheck racecheck initcheck synccheck}"
limit="${LIMIT:-300}"
sum="$out/sanitize.txt"
if ! command -v compute-sanitizer > /dev/null; then
  echo "compute-sanitizer is not on PATH (the CUDA toolkit installs it, e.g. in /usr/local/cuda/bin)" >&2
  exit 1
fi
: > "$sum"
export QEVICT_GPU_QUICK=1
status=0
for prog in $programs; do
  if ! [ -x "$bin/$prog" ]; then echo "$prog: not found in $bin" | tee -a "$sum"; status=1; continue; fi
  # This case makes a cudaMalloc fail on purpose and checks the free memory after it: under a
  # sanitizer both the reported API error and the sanitizer's own allocations are expected.
  filter=()
  [ "$prog" = test_cuda_backend ] && filter=(-tce="*runs out of device memory*")
  for tool in $tools; do
    log="$out/${tool}_$prog.log"
    t0=$(date +%s)
    timeout -k 10 "$limit" compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin/$prog" "${filter[@]}" > "$log" 2>&1
    rc=$?
    # compute-sanitizer exits 255 when the program ends before its first CUDA call: if the
    # program itself passed, the tool had nothing to check.
    if [ $rc -eq 255 ] && grep -q "terminated before first instrumented API call" "$log" && grep -q "Status: SUCCESS" "$log"; then
      rc=nothing
    fi
    case $rc in
      0) verdict="clean" ;;
      nothing) verdict="nothing to check: the program passed without a CUDA call"; [ $status -eq 0 ] && status=2 ;;
      9) verdict="ERRORS"; status=1 ;;
      124) verdict="reached the ${limit} s limit: inconclusive"; [ $status -eq 0 ] && status=2 ;;
      77) verdict="skipped: the program found no CUDA device"; [ $status -eq 0 ] && status=2 ;;
      *) verdict="FAILED (exit $rc)"; status=1 ;;
    esac
    cases=$(grep -h 'test cases:' "$log" | tr -s ' ')
    summary=$(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1 | sed 's/^=* *//')
    echo "$tool $prog: $verdict ($(( $(date +%s) - t0 )) s) ${cases:+| $cases }${summary:+| $summary}" | tee -a "$sum"
  done
done
exit $status
