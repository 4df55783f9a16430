#!/usr/bin/env bash
# bench/gpu/sanitize.sh's verdicts and exit statuses, with a stand-in compute-sanitizer
# (stand_in/compute-sanitizer) over a stand-in test program (sanitize_stand_in.cpp), so that they
# are checked on a machine without a GPU.
#   test_sanitize.sh <stand-in program> <source dir>
set -uo pipefail
program=$1
root=$2
script="$root/bench/gpu/sanitize.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"
# test_cuda_backend is the name under which the script leaves the out-of-memory case out.
ln -s "$program" "$work/bin/test_stand_in"
ln -s "$program" "$work/bin/test_cuda_backend"
export PATH="$root/tests/scripts/stand_in:$PATH" BIN="$work/bin"
unset STAND_IN_NO_DEVICE STAND_IN_FAIL STAND_IN_SLEEP STAND_IN_LOG STAND_IN_RUNNING STAND_IN_TOOL_ERRORS STAND_IN_NO_CUDA_CALL
unset PROGRAMS TOOLS JOBS LIMIT

failures=0
run=0
# fail <message> [file]: one failed check, with the file shown beneath it.
fail() {
  echo "FAIL run $run: $1"
  [ -n "${2:-}" ] && sed 's/^/    /' "$2" 2> /dev/null
  failures=$((failures + 1))
}
# sanitize <expected exit> [VAR=value ...]: runs the script with the settings into a fresh $OUT.
sanitize() {
  local expected=$1; shift
  run=$((run + 1))
  out="$work/out$run"
  env OUT="$out" "$@" bash "$script" > "$work/stdout$run" 2>&1
  local rc=$?
  [ $rc -eq "$expected" ] || fail "($*): exit $rc, expected $expected" "$work/stdout$run"
}
# has <fixed text>: a line of the last run's sanitize.txt holds it.
has() {
  grep -qF -- "$1" "$out/sanitize.txt" 2> /dev/null || fail "no line with '$1' in sanitize.txt:" "$out/sanitize.txt"
}
# count <grep option> <pattern> <file>: how many lines of the file match (0 if there is no file).
count() {
  local n; n=$(grep -c "$1" -- "$2" "$3" 2> /dev/null)
  echo "${n:-0}"
}
# ran <count> <case>: the stand-in's log ($work/ran) holds that case that many times.
ran() {
  local n; n=$(count -x "$2" "$work/ran")
  [ "$n" -eq "$1" ] || fail "case '$2' ran $n times, expected $1"
}
# lines <count> <fixed text>: that many lines of the last run's sanitize.txt hold it.
lines() {
  local n; n=$(count -F "$2" "$out/sanitize.txt")
  [ "$n" -eq "$1" ] || fail "$n lines with '$2' in sanitize.txt, expected $1:" "$out/sanitize.txt"
}

# Clean, one process a program: every case runs; under test_cuda_backend's name all but one.
sanitize 0 PROGRAMS="test_stand_in test_cuda_backend" TOOLS="memcheck racecheck"
has "memcheck test_stand_in: clean"
has "racecheck test_stand_in: clean"
lines 2 "test cases: 3 | 3 passed | 0 failed | 0 skipped"
lines 2 "test cases: 2 | 2 passed | 0 failed | 1 skipped"
has "RACECHECK SUMMARY: 0 errors"

# Clean, one process a case: a line a case (the comma-bearing name matched), then the program's;
# each case ran once a tool.
sanitize 0 PROGRAMS="test_stand_in test_cuda_backend" TOOLS="memcheck racecheck" JOBS=2 STAND_IN_LOG="$work/ran"
lines 10 "test cases: 1 | 1 passed | 0 failed"
has "memcheck test_stand_in [case 1/3: a case whose name has commas, brackets [x] and 20%]: clean"
has "racecheck test_stand_in: clean in every case (3 cases, 2 at once"
has "memcheck test_cuda_backend: clean in every case (2 cases, 2 at once"
ran 4 commas
ran 4 plain
ran 2 memory  # the out-of-memory case: left out under test_cuda_backend's name

# At most JOBS processes at once (each case, as it starts, counts the cases running beside it).
sanitize 0 PROGRAMS=test_stand_in TOOLS="memcheck racecheck initcheck" JOBS=2 STAND_IN_SLEEP=0.5 STAND_IN_RUNNING="$work/running"
most=$(sort -n "$work/running.counts" | tail -1)
[ "$(wc -l < "$work/running.counts")" -eq 9 ] && [ "$most" -le 2 ] || fail "$(wc -l < "$work/running.counts") cases started, at most $most at once; expected 9, at most 2"

# A failed case fails the run, in either mode; under test_cuda_backend's name that case is left out.
sanitize 1 PROGRAMS="test_stand_in" TOOLS=memcheck STAND_IN_FAIL=plain
has "memcheck test_stand_in: FAILED (exit 1)"
sanitize 1 PROGRAMS="test_stand_in test_cuda_backend" TOOLS=memcheck JOBS=3 STAND_IN_FAIL=plain
has "memcheck test_stand_in [case 2/3: a plain case]: FAILED (exit 1)"
has "memcheck test_stand_in [case 1/3: a case whose name has commas, brackets [x] and 20%]: clean"
has "memcheck test_stand_in: ERRORS or FAILED in a case (above)"
has "memcheck test_cuda_backend: ERRORS or FAILED in a case (above)"
sanitize 1 PROGRAMS="test_stand_in test_cuda_backend" TOOLS=memcheck JOBS=3 STAND_IN_FAIL=memory
has "memcheck test_stand_in: ERRORS or FAILED in a case (above)"
has "memcheck test_cuda_backend: clean in every case (2 cases"

# Errors the tool reports fail the run.
sanitize 1 PROGRAMS=test_stand_in TOOLS=racecheck STAND_IN_TOOL_ERRORS=1
has "racecheck test_stand_in: ERRORS"
has "RACECHECK SUMMARY: 1 error"
sanitize 1 PROGRAMS=test_stand_in TOOLS=racecheck JOBS=4 STAND_IN_TOOL_ERRORS=1
lines 3 "]: ERRORS"

# A run stopped at its limit is inconclusive (exit 2), in either mode; a failure outweighs it.
sanitize 2 PROGRAMS=test_stand_in TOOLS=memcheck LIMIT=1 STAND_IN_SLEEP=5
has "memcheck test_stand_in: reached the 1 s limit: inconclusive"
sanitize 2 PROGRAMS=test_stand_in TOOLS=memcheck LIMIT=1 JOBS=3 STAND_IN_SLEEP=5
lines 3 "reached the 1 s limit: inconclusive"
has "memcheck test_stand_in: inconclusive in a case (above)"
sanitize 1 PROGRAMS="test_stand_in test_missing" TOOLS=memcheck LIMIT=1 STAND_IN_SLEEP=5
has "test_missing: not found in"
sanitize 1 PROGRAMS="test_missing test_stand_in" TOOLS=memcheck LIMIT=1 JOBS=2 STAND_IN_SLEEP=5
has "memcheck test_stand_in: inconclusive in a case (above)"

# Without a GPU the program lists no case and runs as one process: skipped, inconclusive.
sanitize 2 PROGRAMS=test_stand_in TOOLS=memcheck JOBS=3 STAND_IN_NO_DEVICE=1
has "memcheck test_stand_in: skipped: the program found no CUDA device"

# A program that passes without a CUDA call gave the tool nothing to check.
sanitize 2 PROGRAMS=test_stand_in TOOLS=memcheck STAND_IN_NO_CUDA_CALL=1
has "memcheck test_stand_in: nothing to check: the program passed without a CUDA call"
sanitize 1 PROGRAMS=test_stand_in TOOLS=memcheck STAND_IN_NO_CUDA_CALL=1 STAND_IN_FAIL=plain
has "memcheck test_stand_in: FAILED (exit 255)"

# Bad settings are refused by name.
sanitize 1 JOBS=0
grep -q "JOBS must be a positive whole number, not '0'" "$work/stdout$run" || fail "JOBS=0 not refused by name"
sanitize 1 JOBS=two
grep -q "JOBS must be a positive whole number, not 'two'" "$work/stdout$run" || fail "JOBS=two not refused by name"

echo "$run runs of sanitize.sh, $failures failed checks"
[ $failures -eq 0 ]
