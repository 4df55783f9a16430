#!/usr/bin/env bash
# One device call for kernel work: builds the GPU test and the decode benchmark for the current
# include tree, a baseline include tree ($BASE_INCLUDE, e.g. a git archive of an earlier commit) and
# variants given as -D flags ($VARIANTS, ';'-separated), times them all with decode_peers, runs the
# test, and optionally profiles one point with ncu. Logs under $OUT.
#   BASE_INCLUDE=.gpu/v1/include VARIANTS="-DQEVICT_DECODE_STAGES=3 -DQEVICT_DECODE_MIN_BLOCKS=1" bench/gpu/tune_run.sh
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out" /tmp/tb
flags="-std=c++20 --expt-relaxed-constexpr -O3 -arch=sm_90"
doctest_inc="${DOCTEST_INCLUDE:-.gpu/include}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
pids=()
(nvcc $flags -Iinclude -I"$doctest_inc" tests/gpu/test_decode_attention.cu -o /tmp/tb/test > "$out/build_test.log" 2>&1) & pids+=($!)
(nvcc $flags -Iinclude -Xptxas -v bench/gpu/decode_peers.cu -o /tmp/tb/peers_new > "$out/build_new.log" 2>&1) & pids+=($!)
(nvcc $flags -Iinclude bench/gpu/decode_point.cu -o /tmp/tb/point > /dev/null 2>&1) & pids+=($!)
if [ -n "${BASE_INCLUDE:-}" ]; then
  (nvcc $flags -I"$BASE_INCLUDE" bench/gpu/decode_peers.cu -o /tmp/tb/peers_base > "$out/build_base.log" 2>&1) & pids+=($!)
fi
i=0
IFS=';' read -ra vars <<< "${VARIANTS:-}"
for v in "${vars[@]}"; do
  i=$((i+1)); (nvcc $flags -Iinclude $v bench/gpu/decode_peers.cu -o /tmp/tb/peers_v$i > "$out/build_v$i.log" 2>&1) & pids+=($!)
done
for p in "${pids[@]}"; do wait $p; done
reps="${REPS:-20}"
for b in new base $(seq -s ' ' 1 $i | sed 's/[0-9]*/v&/g'); do
  [ -x /tmp/tb/peers_$b ] || { echo "peers_$b: no binary" | tee -a "$out/summary.txt"; continue; }
  timeout 120 /tmp/tb/peers_$b $reps > "$out/t_$b.jsonl" 2>&1; echo "peers_$b rc=$?" | tee -a "$out/summary.txt"
done
if [ -x /tmp/tb/test ]; then
  (cd /tmp/tb && timeout ${TEST_TIMEOUT:-300} ./test 2>&1 | tail -${TEST_TAIL:-80}) > "$out/test.log" 2>&1
  echo "test rc=$?" | tee -a "$out/summary.txt"; grep -E "test cases|assertions" "$out/test.log" | tee -a "$out/summary.txt"
else
  echo "test BUILD FAILED" | tee -a "$out/summary.txt"; tail -20 "$out/build_test.log"
fi
if [ -n "${NCU_POINT:-}" ] && [ -x /tmp/tb/point ]; then
  timeout 150 ncu --clock-control none -k regex:decode_attention_kernel -c 1 --section SpeedOfLight --section Occupancy \
    --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis /tmp/tb/point $NCU_POINT 0 > "$out/ncu.txt" 2>&1
  echo "ncu rc=$?" | tee -a "$out/summary.txt"
fi
command -v cuobjdump > /dev/null && cuobjdump -sass /tmp/tb/peers_new 2>/dev/null | awk '/Function : .*decode_attention_kernelILi128ELNS_12element_typeE2ELb1E/{p=1} p&&/Function : /&&!/decode_attention_kernelILi128ELNS_12element_typeE2ELb1E/{p=0} p' > /tmp/tb/k.sass && \
  { echo "sass lines $(wc -l < /tmp/tb/k.sass)"; grep -oE "(LDGSTS|LDSM[.A-Z0-9]*|HMMA[.A-Z0-9]*|LDS[.A-Z0-9]*|LDL|STL|F2FP[.A-Z0-9]*|DMUL|DFMA)" /tmp/tb/k.sass | sort | uniq -c; } > "$out/sass_stats.txt"
grep -h "decode_attention_kernel\|registers" "$out/build_new.log" | grep -A1 "Compiling.*decode_attention_kernel" | grep Used > "$out/regs.txt"
python3 - "$out" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(out, "t_*.jsonl"))):
    name = os.path.basename(f)[2:-6]
    for l in open(f):
        if l.startswith("{"):
            r = json.loads(l); rows.setdefault((r["batch"], r["context"], r["budget"]), {})[name] = r
names = sorted({n for v in rows.values() for n in v})
print("| batch | context | budget | " + " | ".join(f"{n} ms (no mass) TB/s" for n in names) + " |")
for k in sorted(rows, key=lambda k: (-k[0], k[1], -k[2])):
    cells = []
    for n in names:
        r = rows[k].get(n)
        cells.append(f"{r['ms']:.4f} ({r['ms_no_mass']:.4f}) {r['bytes']/r['ms']/1e9:.2f}" if r else "-")
    print(f"| {k[0]} | {k[1]} | {k[2]:.2f} | " + " | ".join(cells) + " |")
PY
cat "$out/summary.txt"
