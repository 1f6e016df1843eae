#!/usr/bin/env bash
# device-profile.sh -- where the CUDA backend's time goes, on the device (ncu; no nsys there).
# One forward + backward of `build/nsa bench --branches --profile` (paper config) at T=$PROF_T, then:
#   MODE=durations  every kernel's duration, in launch order (default)
#   MODE=metrics    instructions by pipe, issue rate, active warps and stall reasons of the
#                   attention kernels (KREGEX, SKIP, NLAUNCH pick which launches)
#   MODE=sass       executed instructions and stall samples per SASS line of one kernel,
#                   summarised by opcode, hottest lines last
# Binaries: build/ or NSA_PREBUILT=dir. Output under $OUT (default ./device-out).
#   MODE=metrics KREGEX='select_kernel' PROF_T=65536 bash scripts/device-profile.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/device-out}"
mkdir -p "$OUT"
BIN="${NSA_PREBUILT:-build}"
T="${PROF_T:-65536}"
K="${KREGEX:-qtile|select_kernel|ktile}"
# PROF_CMD: profile another program instead (e.g. "python3 bench/window_scan.py --W 64 --no-flex")
read -r -a CMD <<< "${PROF_CMD:-$BIN/nsa bench --branches --T $T --profile}"
case "${MODE:-durations}" in
durations)
    timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv "${CMD[@]}" > "$OUT/durations.csv" 2>&1
    echo "ncu rc $?"
    python3 - "$OUT/durations.csv" <<'PY'
import csv, sys
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
h = rows[0]
k, v, u, g = h.index("Kernel Name"), h.index("Metric Value"), h.index("Metric Unit"), h.index("Grid Size")
scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}
tot = 0.0
for r in rows[1:]:
    ms = float(r[v].replace(',', '')) * scale.get(r[u], 1.0)
    tot += ms
    print(f"{ms:9.3f} ms  {r[g]:>16}  {r[k][:80]}")
print(f"{tot:9.3f} ms  total")
PY
    ;;
metrics)
    M=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.per_cycle_active
    M=$M,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed_pipe_alu.sum
    M=$M,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_xu.sum,smsp__inst_executed_op_ldsm.sum,lts__t_sector_hit_rate.pct
    for r in barrier long_scoreboard short_scoreboard math_pipe_throttle mio_throttle lg_throttle wait not_selected dispatch_stall branch_resolving; do
        M="$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
    done
    timeout 400 ncu --clock-control none -k "regex:$K" --launch-skip "${SKIP:-0}" --launch-count "${NLAUNCH:-11}" --metrics "$M" \
        "${CMD[@]}" > "$OUT/metrics.txt" 2>&1
    echo "ncu rc $?"
    grep -E "^  [a-z_ ]+.*\(|duration|inst_executed|stalled|hmma|issue_active|warps_active|hit_rate" "$OUT/metrics.txt" |
        sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio/ (stall cycles per issue)/' | cut -c1-140
    ;;
sass)
    timeout 300 ncu --clock-control none -k "regex:$K" --launch-skip "${SKIP:-0}" --launch-count 1 --section SourceCounters \
        --page source --print-source sass --csv "${CMD[@]}" > "$OUT/sass.csv" 2>&1
    echo "ncu rc $?"
    python3 - "$OUT/sass.csv" <<'PY'
import csv, sys, collections
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
h = rows[1]
ii, si, ai, wi = h.index("Instructions Executed"), h.index("Source"), h.index("Address"), h.index("Warp Stall Sampling (All Samples)")
data = []
for r in rows[2:]:
    try: data.append((float(r[ii].replace(',', '')), r[ai], r[si], float(r[wi].replace(',', '') or 0)))
    except ValueError: pass
ti = sum(d[0] for d in data) or 1; tw = sum(d[3] for d in data) or 1
ops, opw = collections.Counter(), collections.Counter()
for v, a, s, w in data:
    t = s.split(); op = (t[1] if t and t[0].startswith('@') and len(t) > 1 else (t[0] if t else '?')).split('.')[0]
    ops[op] += v; opw[op] += w
print(f"{ti:.0f} warp instructions executed")
for op, v in ops.most_common(20): print(f"{v/ti*100:5.1f}% of instructions {opw[op]/tw*100:5.1f}% of stall samples  {op}")
for v, a, s, w in sorted(sorted(data, key=lambda d: -d[3])[:40], key=lambda d: d[1]): print(f"{v/ti*100:5.2f}% {w/tw*100:5.2f}% {a} {s[:80]}")
PY
    ;;
esac
