#!/usr/bin/env bash
# Builds and runs the whole test suite: every test (the GPU tests skip themselves without a GPU;
# every CUDA file is still compiled when nvcc exists), then every CPU test again under
# AddressSanitizer and UndefinedBehaviorSanitizer.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc)
"$root/scripts/install-deps.sh"

echo "== release build: all tests, examples and benchmarks"
cmake -S "$root" -B "$root/build/release" -DCMAKE_BUILD_TYPE=Release -DQEVICT_BUILD_BENCHMARKS=ON >/dev/null
cmake --build "$root/build/release" -j"$jobs"
ctest --test-dir "$root/build/release" --output-on-failure -j"$jobs"

echo "== every CPU test again under AddressSanitizer + UndefinedBehaviorSanitizer"
cmake -S "$root" -B "$root/build/sanitize" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQEVICT_SANITIZE=ON \
      -DQEVICT_ENABLE_CUDA=OFF -DQEVICT_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$root/build/sanitize" -j"$jobs"
ctest --test-dir "$root/build/sanitize" -LE "gpu|package" --output-on-failure -j"$jobs"
