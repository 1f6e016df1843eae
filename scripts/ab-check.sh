#!/usr/bin/env bash
# ab-check.sh -- two or more prebuilt builds of the CUDA backend side by side on one GPU, for a
# change that must not move any bit or any millisecond (a refactor):
#   PART=check  the GPU sweep of the first build writes a hash of every output per case; every
#               other build runs the same cases against the float64 reference and compares its
#               hashes ("N identical, M differ"), on the default tiles and under each planner
#               override (the fallback tiles); then compute-sanitizer memcheck and racecheck on
#               the last build;
#   PART=time   CUDA-event timings, the builds interleaved ROUNDS times in one process tree:
#               the whole NSA forward / backward per length (nsa bench --branches) and dense
#               causal attention's forward (nsa bench --op dense); TIME_VARIANTS="NAME=value ..."
#               times the branches again under those overrides (at VT, default 16384).
# Each build is a folder holding nsa_gpu_tests and nsa (both from this tree's test kit and CLI,
# linked against that build's libnsa.a, so only the library differs).
#
#   BUILDS="old new" DIR=.ab PART=check bash scripts/ab-check.sh
#   BUILDS="old new" DIR=.ab PART=time T=16384,65536 bash scripts/ab-check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/ab-out}"
DIR="${DIR:-.ab}"
BUILDS=(${BUILDS:-old new})
PART="${PART:-check}"
SEED="${SEED:-20260301}"
CASES="${CASES:-64}"
VCASES="${VCASES:-16}"
MAXT="${MAXT:-1000}"
JOBS="${JOBS:-8}"
T="${T:-16384,65536}"
ROUNDS="${ROUNDS:-2}"
VARIANTS="${VARIANTS:-NSA_CUDA_WGMMA=0 NSA_CUDA_KWP=0 NSA_CUDA_SLC_RP=1 NSA_CUDA_SLC_NP=1}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary-$PART.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
note "gpu: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader 2>/dev/null | head -1)"
base="${BUILDS[0]}"

sweep() { # build label cases [env...]: one sweep, hashes out (first build) or compared (others)
    local b=$1 label=$2 n=$3; shift 3
    local h=(--hash-out "$OUT/hash-$label-$b.txt")
    [ "$b" != "$base" ] && h+=(--hash-cmp "$OUT/hash-$label-$base.txt")
    env "$@" timeout 300 "$DIR/$b/nsa_gpu_tests" --seed "$SEED" --cases "$n" --max-T "$MAXT" --jobs "$JOBS" "${h[@]}" \
        > "$OUT/sweep-$label-$b.log" 2>&1
    local rc=$? res cmp
    res=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$OUT/sweep-$label-$b.log" | tail -1)
    cmp=$(grep -E '^[0-9]+ identical, [0-9]+ differ$' "$OUT/sweep-$label-$b.log" | tail -1)
    note "sweep $label $b: $res (rc $rc)${cmp:+; vs $base: $cmp}"
    grep -E '^(FAIL|hash: )' "$OUT/sweep-$label-$b.log" | head -5 | cut -c1-240 | tee -a "$SUMMARY"
}

if [ "$PART" = check ]; then
    [ -x "$DIR/${BUILDS[-1]}/nsa_wgmma_test" ] && note "wgmma primitives: $(timeout 60 "$DIR/${BUILDS[-1]}/nsa_wgmma_test" 2>&1 | tail -1)"
    for b in "${BUILDS[@]}"; do sweep "$b" default "$CASES"; done
    for v in $VARIANTS; do
        for b in "${BUILDS[@]}"; do sweep "$b" "${v#NSA_CUDA_}" "$VCASES" "$v" NSA_TEST_ATTENTION_QUICK=1; done
    done
    last="$DIR/${BUILDS[-1]}/nsa_gpu_tests"
    timeout 150 compute-sanitizer --tool memcheck --print-limit 10 "$last" --no-fork --seed 7 --cases 6 --max-T 300 --no-attention > "$OUT/memcheck.log" 2>&1
    note "memcheck ${BUILDS[-1]}: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) / $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$OUT/memcheck.log" | tail -1)"
    timeout 200 compute-sanitizer --tool racecheck --print-limit 10 "$last" --no-fork --seed 11 --cases 8 --max-T 600 --no-attention > "$OUT/racecheck.log" 2>&1
    note "racecheck ${BUILDS[-1]}: $(grep -E 'RACECHECK SUMMARY' "$OUT/racecheck.log" | tail -1) / $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$OUT/racecheck.log" | tail -1)"
else
    for r in $(seq "$ROUNDS"); do
        for b in "${BUILDS[@]}"; do
            timeout 200 "$DIR/$b/nsa" bench --branches --T "$T" --reps "${REPS:-10}" > "$OUT/branches-$b-$r.log" 2>&1
            note "round $r $b branches (rc $?):"
            tail -n +2 "$OUT/branches-$b-$r.log" | tee -a "$SUMMARY"
            timeout 120 "$DIR/$b/nsa" bench --backend cuda --op dense --T 16384 --HQ 64 --H 4 --D 128 --dtype bf16 \
                --reps "${REPS:-10}" > "$OUT/dense-$b-$r.log" 2>&1
            note "round $r $b dense 16k: $(grep -E '^ +16384 +fwd +dense' "$OUT/dense-$b-$r.log" | tr -s ' ')"
            for v in ${TIME_VARIANTS:-}; do # the same bench under a planner override (a fallback tile's time)
                env "$v" timeout 200 "$DIR/$b/nsa" bench --branches --T "${VT:-16384}" --reps "${REPS:-10}" > "$OUT/branches-$b-$r-$v.log" 2>&1
                note "round $r $b branches with $v:"
                tail -n +3 "$OUT/branches-$b-$r-$v.log" | tee -a "$SUMMARY"
            done
        done
    done
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> "$SUMMARY" 2>&1
