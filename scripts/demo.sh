#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main demo: the stories260K model generating
# text through qevict (20% budget) and through a full cache, side by side. Extra arguments go
# to the demo (try --help).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$root/build/release" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$root/build/release" -j"$(nproc)" --target qevict_demo
"$root/build/release/examples/llama/qevict_demo" "$@"
