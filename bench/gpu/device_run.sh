#!/usr/bin/env bash
# One call on the GPU machine: build the GPU tests and the decode benchmark with nvcc, run them,
# leave logs in $OUT. QEVICT_INCLUDE selects the include tree (default: include/).
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
inc="${QEVICT_INCLUDE:-include}"
doctest_inc="${DOCTEST_INCLUDE:-.gpu/include}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
ls /usr/include/benchmark /usr/include/doctest 2>&1 | head -3 >> "$out/gpu.txt"
mkdir -p /tmp/b
flags="-std=c++20 --expt-relaxed-constexpr -O3 -arch=sm_90 -I$inc -I$doctest_inc"
pids=()
for t in ${TESTS:-tests/gpu/test_*.cu}; do
  n=$(basename "$t" .cu)
  (nvcc $flags "$t" -o /tmp/b/$n > "$out/build_$n.log" 2>&1) & pids+=($!)
done
for p in "${pids[@]}"; do wait $p; done
for t in ${TESTS:-tests/gpu/test_*.cu}; do
  n=$(basename "$t" .cu)
  if [ -x /tmp/b/$n ]; then
    (cd /tmp/b && timeout ${TEST_TIMEOUT:-240} ./$n 2>&1 | tail -${TEST_TAIL:-60}) > "$out/$n.log" 2>&1
    echo "$n rc=$?" | tee -a "$out/summary.txt"
  else
    echo "$n BUILD FAILED" | tee -a "$out/summary.txt"; tail -20 "$out/build_$n.log"
  fi
done
if [ "${PEERS:-1}" = 1 ]; then
  QEVICT_INCLUDE="$inc" timeout ${PEERS_TIMEOUT:-300} bench/gpu/run_peers.sh /tmp/bp > "$out/peers.log" 2>&1
  echo "peers rc=$?" | tee -a "$out/summary.txt"
  cp /tmp/bp/table.md "$out/" 2>/dev/null
fi
cat "$out/summary.txt"
if [ -n "${VARIANT_FLAGS:-}" ]; then
  nvcc -std=c++20 --expt-relaxed-constexpr -O3 -arch=sm_90 -I"$inc" $VARIANT_FLAGS bench/gpu/decode_peers.cu -o /tmp/bp/decode_variant \
    && /tmp/bp/decode_variant 15 > "$out/variant.jsonl" 2>&1
  echo "variant rc=$?" | tee -a "$out/summary.txt"
fi
