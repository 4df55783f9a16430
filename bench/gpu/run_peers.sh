#!/usr/bin/env bash
# Decode attention, one layer of Llama-3.1-8B geometry: the qevict kernel at budgets 20/10/5/100%
# (with and without window mass), PyTorch SDPA flash and cuDNN over the full bf16 cache, and the
# device-to-device copy bandwidth, all in one run on one GPU. Prints a markdown table.
#   bench/gpu/run_peers.sh [build-dir]     (needs nvcc for sm_90 and python3 with PyTorch)
# L2 is flushed before every timed call: QEVICT_BENCH_FLUSH=dirty (default, a 256 MiB memset) or
# clean (the memset, then a read of another 256 MiB, so that no written lines are left in L2);
# both the qevict rows and the PyTorch peers follow it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="${1:-$root/build-peers}"
include="${QEVICT_INCLUDE:-$root/include}"
mkdir -p "$build"
nvcc -std=c++20 --expt-relaxed-constexpr -O3 -arch=sm_90 -I"$include" "$here/decode_peers.cu" -o "$build/decode_peers"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader || true
"$build/decode_peers" | tee "$build/qevict.jsonl"
python3 "$here/peers.py" measure | tee "$build/peers.jsonl"
python3 "$here/peers.py" report "$build/qevict.jsonl" "$build/peers.jsonl" | tee "$build/table.md"
