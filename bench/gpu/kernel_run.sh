#!/usr/bin/env bash
# One device call for decode-kernel work: builds the GPU tests and the decode benchmark in
# parallel, times both record key frames at one point, runs the GPU tests, optionally profiles the
# point with ncu (per-instruction SASS counts) and runs the peers table (bench/gpu/run_peers.sh).
# Everything lands in $OUT/logs.tar.gz; the summary is printed.
#   POINT="32 32768 0.2" TEST=1 NCU=1 PEERS=0 SANITIZE=0 bench/gpu/kernel_run.sh
set -uo pipefail
out="${OUT:-/tmp/out}"; logs=/tmp/klogs; mkdir -p "$out" "$logs" /tmp/kb
flags="-std=c++20 --expt-relaxed-constexpr -O3 -arch=sm_90 -Iinclude"
doctest_inc="${DOCTEST_INCLUDE:-.gpu/include}"
sum="$logs/summary.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$logs/gpu.txt"
t0=$(date +%s)
for t in ${TESTS:-tests/gpu/test_*.cu}; do
  n=$(basename "$t" .cu)
  (nvcc $flags -I"$doctest_inc" -Itests "$t" -o /tmp/kb/$n > "$logs/build_$n.log" 2>&1) &
done
(nvcc $flags -Xptxas -v bench/gpu/decode_point.cu -o /tmp/kb/decode_point > "$logs/build_point.log" 2>&1) &
wait
echo "build $(( $(date +%s) - t0 )) s" | tee -a "$sum"
point="${POINT:-32 32768 0.2}"
for frame in pre relative post; do
  timeout 60 /tmp/kb/decode_point $point 30 64 $frame | tee -a "$sum"
done
if [ "${TEST:-1}" = 1 ]; then
  for t in ${TESTS:-tests/gpu/test_*.cu}; do
    n=$(basename "$t" .cu)
    [ -x /tmp/kb/$n ] || { echo "$n: BUILD FAILED" | tee -a "$sum"; tail -5 "$logs/build_$n.log"; continue; }
    t0=$(date +%s)
    timeout "${TEST_TIMEOUT:-200}" /tmp/kb/$n > "$logs/$n.log" 2>&1
    echo "$n rc=$? ($(( $(date +%s) - t0 )) s): $(grep -h 'test cases:' "$logs/$n.log")" | tee -a "$sum"
    grep -h -B3 -A8 "ERROR" "$logs/$n.log" | head -40
  done
fi
if [ "${SANITIZE:-0}" = 1 ] && [ -x /tmp/kb/test_cuda_backend ]; then
  for tool in memcheck racecheck; do
    QEVICT_GPU_QUICK=1 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 /tmp/kb/test_cuda_backend \
      > "$logs/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$?: $(tail -1 "$logs/sanitizer_$tool.log")" | tee -a "$sum"
  done
fi
if [ "${NCU:-0}" = 1 ]; then
  timeout 200 ncu -k regex:decode_attention_kernel --set full -o /tmp/kb/prof /tmp/kb/decode_point $point 0 64 post > "$logs/ncu_run.log" 2>&1
  ncu -i /tmp/kb/prof.ncu-rep --page details > "$logs/ncu_details.txt" 2>&1
  ncu -i /tmp/kb/prof.ncu-rep --page source --csv --print-source sass > "$logs/ncu_sass.csv" 2>&1
  echo "ncu rc=$?" | tee -a "$sum"
fi
if [ "${PEERS:-0}" = 1 ]; then
  t0=$(date +%s)
  timeout "${PEERS_TIMEOUT:-300}" bench/gpu/run_peers.sh /tmp/bp > "$logs/peers.log" 2>&1
  echo "peers rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$sum"
  cp /tmp/bp/table.md /tmp/bp/*.jsonl "$logs/" 2>/dev/null
fi
tar czf "$out/logs.tar.gz" -C "$logs" .
cat "$sum"
