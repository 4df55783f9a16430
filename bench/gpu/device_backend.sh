#!/usr/bin/env bash
# One call on the GPU machine for the CUDA backend: its GPU test against the host backend (quick
# set first; the rest only if that passes), the routing-cost benchmark, then compute-sanitizer
# memcheck, racecheck, initcheck and synccheck on the quick set (bench/gpu/sanitize.sh). Logs
# in $OUT.
#   BIN:     prebuilt binaries (test_cuda_backend, routing_cost); rebuilt here with nvcc if they
#            do not start on this machine
#   INC:     include tree to build against (default include/); DOCTEST_INCLUDE: doctest's folder
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
bin="${BIN:-.gpu/backend-bin}"
inc="${INC:-include}"
doctest_inc="${DOCTEST_INCLUDE:-.gpu/include}"
sum="$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
if ! "$bin/test_cuda_backend" --list-test-cases > /dev/null 2>&1 || ! [ -x "$bin/routing_cost" ]; then
  echo "prebuilt binaries do not run here: building with nvcc" | tee -a "$sum"
  mkdir -p /tmp/b
  flags="-std=c++20 --expt-relaxed-constexpr -arch=sm_90 -I$inc"
  nvcc $flags -O2 -I"$doctest_inc" -Itests tests/gpu/test_cuda_backend.cu -o /tmp/b/test_cuda_backend > "$out/build_test.log" 2>&1 &
  nvcc $flags -O3 bench/gpu/routing_cost.cu -o /tmp/b/routing_cost > "$out/build_bench.log" 2>&1 &
  wait
  bin=/tmp/b
fi
t0=$(date +%s)
QEVICT_GPU_QUICK=1 timeout "${QUICK_TIMEOUT:-60}" "$bin/test_cuda_backend" > "$out/test_quick.log" 2>&1
rc=$?; echo "quick test rc=$rc ($(( $(date +%s) - t0 )) s)" | tee -a "$sum"
if [ $rc -ne 0 ]; then tail -60 "$out/test_quick.log"; exit 1; fi
t0=$(date +%s)
timeout "${BENCH_TIMEOUT:-90}" "$bin/routing_cost" "${ROUNDS:-20}" > "$out/routing_cost.md" 2>&1
echo "routing_cost rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$sum"
t0=$(date +%s)
timeout "${FULL_TIMEOUT:-150}" "$bin/test_cuda_backend" > "$out/test_full.log" 2>&1
echo "full test rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$sum"
# The four tools over the reduced set, by the sweep script (a line a tool in $out/sanitize.txt).
BIN="$bin" PROGRAMS=test_cuda_backend LIMIT="${SAN_TIMEOUT:-100}" OUT="$out" bash "$(dirname "$0")/sanitize.sh"
echo "compute-sanitizer sweep rc=$?" | tee -a "$sum"
cat "$out/sanitize.txt" >> "$sum"
grep -h "MESSAGE\|d=\|test cases\|assertions\|ERROR\|error" "$out/test_full.log" | tail -30
cat "$out/routing_cost.md"
cat "$sum"
