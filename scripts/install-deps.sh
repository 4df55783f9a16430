#!/usr/bin/env bash
# Installs the Debian packages qevict's build, tests, benchmarks and plots need, if missing.
set -euo pipefail
needed=(cmake g++ make doctest-dev libbenchmark-dev gnuplot-nox)
missing=()
for p in "${needed[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
