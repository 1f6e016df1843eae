#!/usr/bin/env bash
# device-check.sh -- the CUDA backend on a GPU machine, in one go:
#   1. records the GPU (nvidia-smi: name, driver, clocks) and nvcc;
#   2. builds build/nsa_gpu_tests and the CLI (build/nsa) with the Makefile
#      (or uses binaries prebuilt elsewhere: NSA_PREBUILT=dir, if they start);
#   3. the GPU sweep: the random cases of tests/kit/sweep.c against the float64 reference
#      (every call's live workspace takes checked against its sizing pass: NSA_CUDA_CHECK_WORKSPACE=1),
#      every case in its own process (--jobs in parallel), writing a hash of every output
#      to $OUT/hashes.txt; then a short pass (CASES/4) on the mma.sync tiles, the fallback of
#      the wgmma paths (NSA_CUDA_WGMMA=0; AB=1 sweeps all CASES there instead), and one on each
#      other fallback a planner override selects (NSA_CUDA_KWP=0, _SLC_RP=1, _SLC_NP=1,
#      _SWG_WS=0, _CMP_SEG=2 and 256, _RANGE_SEG=1 and 8; _RANGE_PIPE=2 takes the pipelined forward
#      tile everywhere, which the planner keeps for long rows), and one on the scalar kernels of non-finite inputs
#      (NSA_CUDA_NONFINITE=1);
#   4. compute-sanitizer memcheck on a few small cases (RACE=1: racecheck too), and the fuzz
#      inputs (tests/fuzz/regressions, tests/fuzz/corpus) replayed on the CUDA backend by
#      build/nsa_fuzz_replay, plain and under memcheck: a failing call leaves every device
#      buffer untouched, a successful one writes only its outputs, no guard byte changes;
#   5. fla's own NSA tests (peers/fla/tests/ops/test_nsa.py) with parallel_nsa bound to
#      nsa.parallel_nsa: tests/python/test_fla_suite.py, when peers/ (or $NSA_PEERS) is carried
#      and holds that file (scripts/fetch-peers.sh fla); per-case table in $OUT/fla-suite.txt;
#   6. CUDA-event timings of the whole forward / backward and of each branch (paper config,
#      bf16) per length: `nsa bench --branches`;
#   7. with EXTRA="tables cli 1m options peers" (FULL=1 = the first three): the benchmark
#      tables of every config, the CLI's TFLOP/s tables, the 1M-token run, the cost of each
#      attention option (bench/attn_options_gpu.py), and bench/peers.py beside mdy666 / fla
#      (carry peers/; see below; several minutes each); "python" the Python binding's CUDA
#      tests and examples/generate.py on the GPU, "decode" bench/decode.py (one decode step beside
#      mdy666 and dense; DECODE_B, DECODE_CTX), "flex" bench/flex.py (beside torch's FlexAttention;
#      FLEX_T, FLEX_HEADS, FLEX_MODS, FLEX_PASSES, FLEX_REPS; then each of FLEX_FIRST_MODS's first calls,
#      compiled and loaded from the disk cache), "workload" the realistic workload (trains
#      examples/train_tiny.py with the paper's NSA configuration at 8k, HQ 16 / H 1 / D 128,
#      WORKLOAD_STEPS steps; bench/workload.py saves layer WORKLOAD_LAYER's inputs over
#      WORKLOAD_T tokens of held-out text with its overlap and tile unions; bench/peers.py
#      times nsa and mdy666 on them and on random inputs of the same shapes; ~4 minutes).
# ONLY="stage ..." runs only those of sweep, variants, nonfinite, memcheck, cp, fuzz, fla, bench
# (cp: build/nsa_cp_tests, context parallelism over NCCL on every GPU, nothing on one).
# AB=1 sweeps the mma.sync tiles (NSA_CUDA_WGMMA=0) on all CASES and times them for comparison;
# ENVAB="NAME=value ..." times the bench once more under those switches.
# HASH_BASE=dir compares this build's outputs bit for bit with an earlier build's: the sweep
# runs with --hash-cmp dir/hashes.txt and the summary says "N identical, M differ" (cases
# whose every output has the same bytes, and the others; listed in sweep.log). To make the
# base, run this script once with the earlier binaries (built from a tree whose sweep has
# --hash-out) and the same SEED, CASES and MAXT: NSA_PREBUILT=old-bin OUT=dir; it leaves
# dir/hashes.txt. A kernel change that should not move any bit (a refactor) shows 0 differ.
# Logs go to $OUT (default ./device-out); a short table is printed last.
#
#   bash scripts/device-check.sh                     # on a GPU machine
#   SEED=.. CASES=.. BENCH_T=8192,16384 REPS=5 bash scripts/device-check.sh
#   NSA_PREBUILT=.old-bin OUT=base bash scripts/device-check.sh; HASH_BASE=base bash scripts/device-check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/device-out}"
mkdir -p "$OUT"
SEED="${SEED:-20260301}"
CASES="${CASES:-96}"
MAXT="${MAXT:-1000}"
BENCH_T="${BENCH_T:-8192,16384,32768,65536}"
REPS="${REPS:-5}"
JOBS="${JOBS:-8}"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "== $(date +%T) $*"; }
# ONLY="sweep variants nonfinite memcheck cp fuzz fla bench": just those stages (default: all;
# the build, the machine record and EXTRA always run).
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
note() { echo "$*" | tee -a "$SUMMARY"; }

say "machine"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,temperature.gpu --format=csv
    nvidia-smi
    nvcc --version
    nproc
} > "$OUT/gpu.txt" 2>&1
note "gpu: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader 2>/dev/null | head -1)"

BIN=build
if [ -n "${NSA_PREBUILT:-}" ] && "$NSA_PREBUILT/nsa_gpu_tests" --cases 0 --no-attention > /tmp/nsa-prebuilt.txt 2>&1; then
    BIN="$NSA_PREBUILT"
    note "build: prebuilt binaries from $NSA_PREBUILT"
else
    say "build"
    t0=$(date +%s)
    if ! make -j"$(nproc)" NATIVE=0 CFLAGS=-Wno-psabi build/nsa_gpu_tests build/nsa build/nsa_wgmma_test build/libnsa.so build/nsa_fuzz_replay build/nsa_cp_tests > "$OUT/build.log" 2>&1; then
        tail -40 "$OUT/build.log"
        note "build: FAILED"
        exit 1
    fi
    note "build: $(( $(date +%s) - t0 )) s (make -j$(nproc))"
fi
# the per-branch CUDA-event table: the CLI's bench --branches (prebuilt binaries from before
# it existed: their nsa_gpu_bench, same table); the sweep's hash flags where it has them
if grep -q -- --branches <<< "$("$BIN/nsa" bench --help 2>&1)" || [ ! -x "$BIN/nsa_gpu_bench" ]; then
    BENCH=("$BIN/nsa" bench --branches)
else
    BENCH=("$BIN/nsa_gpu_bench")
fi
HASHES=()
if grep -q -- --hash-out <<< "$("$BIN/nsa_gpu_tests" --help 2>&1)"; then
    HASHES=(--hash-out "$OUT/hashes.txt")
    if [ -n "${HASH_BASE:-}" ]; then
        if [ -r "$HASH_BASE/hashes.txt" ]; then HASHES+=(--hash-cmp "$HASH_BASE/hashes.txt")
        else note "hashes: $HASH_BASE/hashes.txt not readable, no comparison"; fi
    fi
elif [ -n "${HASH_BASE:-}" ]; then
    note "hashes: $BIN/nsa_gpu_tests has no --hash-cmp, no comparison"
fi

if [ -x "$BIN/nsa_wgmma_test" ]; then
    say "wgmma primitives"
    timeout 60 "$BIN/nsa_wgmma_test" > "$OUT/wgmma.log" 2>&1
    note "wgmma primitives: $(tail -1 "$OUT/wgmma.log") (rc $?)"
    grep -E "^FAIL" "$OUT/wgmma.log" | tee -a "$SUMMARY"
fi

if want sweep; then
say "gpu sweep ($CASES cases, seed $SEED, max T $MAXT, $JOBS jobs)"
t0=$(date +%s)
# (with every call's workspace takes checked against its sizing pass: NSA_CUDA_CHECK_WORKSPACE)
NSA_CUDA_CHECK_WORKSPACE=1 timeout 240 "$BIN/nsa_gpu_tests" --seed "$SEED" --cases "$CASES" --max-T "$MAXT" --jobs "$JOBS" \
    ${HASHES[@]+"${HASHES[@]}"} > "$OUT/sweep.log" 2>&1
rc=$?
grep -E "^FAIL" "$OUT/sweep.log" | head -30
note "sweep: $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$OUT/sweep.log" | tail -1) (rc $rc, $(( $(date +%s) - t0 )) s; $(grep -c ' (crashed)' "$OUT/sweep.log") crashed)"
note "fixed cases (attention options, step, block-sparse): $(grep -E '^attention options and the step:' "$OUT/sweep.log" | tail -1 | sed -E 's/^[^:]+: +//')"
grep -E "^FAIL" "$OUT/sweep.log" | awk -F' -- ' '{print $1}' | sed -E 's/^FAIL [^ ]+ //' | sort | uniq -c | sort -rn | head -20 | tee -a "$SUMMARY"
if [[ " ${HASHES[*]-} " == *" --hash-cmp "* ]]; then
    note "hashes vs $HASH_BASE: $(grep -E '^[0-9]+ identical, [0-9]+ differ$' "$OUT/sweep.log" | tail -1)"
    grep -E '^hash: ' "$OUT/sweep.log" | head -5 | cut -c1-300 | tee -a "$SUMMARY"
fi
fi # sweep

# The mma.sync tiles, the fallback of every wgmma path (and the only path before Hopper): the
# first CASES/4 of the same cases by default, all CASES under AB=1; the option tests' fixed cases.
if want variants; then
if [ -n "${AB:-}" ]; then MMA_CASES=$CASES; else MMA_CASES=$(( CASES / 4 > 0 ? CASES / 4 : 1 )); fi
say "gpu sweep with NSA_CUDA_WGMMA=0 ($MMA_CASES cases)"
t0=$(date +%s)
NSA_CUDA_WGMMA=0 NSA_TEST_ATTENTION_QUICK=1 timeout 240 "$BIN/nsa_gpu_tests" --seed "$SEED" --cases "$MMA_CASES" --max-T "$MAXT" \
    --jobs "$JOBS" > "$OUT/sweep-mma.log" 2>&1
rc=$?
grep -E "^FAIL" "$OUT/sweep-mma.log" | head -10
note "sweep with NSA_CUDA_WGMMA=0: $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$OUT/sweep-mma.log" | tail -1) ($MMA_CASES cases, rc $rc, $(( $(date +%s) - t0 )) s)"
# The other fallbacks a planner override selects (src/cuda/plan.h): kwg instead of kwp for the
# range dK / dV, the selected tile without union rows or without position pairs, the selection
# with its merge in the products' warpgroup; the compressed dK / dV cut into the fewest (2)
# and the most (256) row segments; the window / dense dK / dV without row segments and with 8
# (the planner cuts them only for few, unequal tasks, which the sweep's small cases seldom
# are); and the scalar kernels of non-finite inputs
# (prim/nonfinite.cuh) on finite inputs; a short pass each on the same first cases.
for v in NSA_CUDA_KWP=0 NSA_CUDA_SLC_RP=1 NSA_CUDA_SLC_NP=1 NSA_CUDA_SWG_WS=0 NSA_CUDA_CMP_SEG=2 NSA_CUDA_CMP_SEG=256 \
    NSA_CUDA_RANGE_SEG=1 NSA_CUDA_RANGE_SEG=8 NSA_CUDA_RANGE_PIPE=2 NSA_CUDA_NONFINITE=1; do
    vlog="$OUT/sweep-${v#NSA_CUDA_}.log"
    NSA_TEST_ATTENTION_QUICK=1 timeout 240 "$BIN/nsa_gpu_tests" --seed "$SEED" --cases "$MMA_CASES" --max-T "$MAXT" \
        --jobs "$JOBS" --variant "$v" > "$vlog" 2>&1
    vrc=$?
    note "sweep with $v: $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$vlog" | tail -1) ($MMA_CASES cases, rc $vrc)"
done
fi # variants

# The non-finite mode (docs/spec.md 0.4): NaN / inf planted in each op's inputs, the outputs'
# non-finite elements compared with the float64 reference's, element for element; on the
# default path (the scalar kernels of prim/nonfinite.cuh take such calls) and with the mma.sync
# tiles and the cp.async dK / dV tile as the finite path. The failures are grouped by op and
# output. (NSA_CUDA_NONFINITE=1 above runs the scalar kernels on the finite sweep.)
if want nonfinite; then
for nfv in "" NSA_CUDA_WGMMA=0 NSA_CUDA_KWP=0; do
    nflog="$OUT/nonfinite${nfv:+-${nfv#NSA_CUDA_}}.log"
    say "gpu non-finite sweep${nfv:+ with $nfv} ($(( CASES / 2 )) cases)"
    t0=$(date +%s)
    NSA_TEST_ATTENTION_QUICK=1 timeout 240 "$BIN/nsa_gpu_tests" --nonfinite --seed "$SEED" --cases $(( CASES / 2 )) --max-T 300 \
        --jobs "$JOBS" ${nfv:+--variant "$nfv"} > "$nflog" 2>&1
    rc=$?
    note "non-finite sweep${nfv:+ with $nfv}: $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$nflog" | tail -1) (rc $rc, $(( $(date +%s) - t0 )) s)"
    grep -E "^FAIL" "$nflog" | sed -E 's/^FAIL [^ ]+ //; s/ -- .*//' | sort | uniq -c | sort -rn | head -12 | tee -a "$SUMMARY"
done
fi # nonfinite

if want memcheck; then
say "memcheck"
t0=$(date +%s)
timeout 120 compute-sanitizer --tool memcheck --print-limit 10 "$BIN/nsa_gpu_tests" --no-fork --seed 7 --cases 4 --max-T 200 --no-attention > "$OUT/memcheck.log" 2>&1
note "memcheck: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) / $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$OUT/memcheck.log" | tail -1) ($(( $(date +%s) - t0 )) s)"
# the scalar kernels on non-finite inputs, under memcheck
t0=$(date +%s)
timeout 120 compute-sanitizer --tool memcheck --print-limit 10 "$BIN/nsa_gpu_tests" --no-fork --nonfinite --seed 7 --cases 4 --max-T 200 --no-attention > "$OUT/memcheck-nonfinite.log" 2>&1
note "memcheck (non-finite): $(grep -E 'ERROR SUMMARY' "$OUT/memcheck-nonfinite.log" | tail -1) / $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$OUT/memcheck-nonfinite.log" | tail -1) ($(( $(date +%s) - t0 )) s)"
# the attention options' general kernels (src/cuda/attention) on the fixed cases of tests/test_attention.c
t0=$(date +%s)
NSA_TEST_ATTENTION_QUICK=1 timeout 240 compute-sanitizer --tool memcheck --print-limit 10 "$BIN/nsa_gpu_tests" --no-fork --cases 0 > "$OUT/memcheck-attention.log" 2>&1
note "memcheck (attention options): $(grep -E 'ERROR SUMMARY' "$OUT/memcheck-attention.log" | tail -1) / $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$OUT/memcheck-attention.log" | tail -1) ($(( $(date +%s) - t0 )) s)"
fi # memcheck

# Context parallelism over NCCL on every GPU of the machine (build/nsa_cp_tests; NCCL from the
# system, or torch's nvidia-nccl wheel): nothing to run on one GPU.
if want cp && [ -x "$BIN/nsa_cp_tests" ]; then
    say "context parallelism (NCCL)"
    NCCL_DIR="$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)"
    t0=$(date +%s)
    LD_LIBRARY_PATH="${NCCL_DIR:+$NCCL_DIR:}${LD_LIBRARY_PATH:-}" timeout 200 "$BIN/nsa_cp_tests" > "$OUT/cp.log" 2>&1
    rc=$?
    grep -E '^FAIL' "$OUT/cp.log" | head -10
    note "context parallelism: $(grep -vE '^[0-9]+ passed, [0-9]+ failed$' "$OUT/cp.log" | tail -1) (rc $rc, $(( $(date +%s) - t0 )) s)"
fi # cp

# The fuzz inputs on the device (tests/fuzz/replay.c): the same byte checks as the CPU fuzzing,
# on device memory; the plain run first (fast, and it names a failing input), then memcheck.
if want fuzz; then
if [ -x "$BIN/nsa_fuzz_replay" ]; then
    say "fuzz replay on cuda"
    FUZZ_IN=(tests/fuzz/regressions tests/fuzz/corpus)
    t0=$(date +%s)
    timeout 120 "$BIN/nsa_fuzz_replay" --backend cuda "${FUZZ_IN[@]}" > "$OUT/fuzz-replay.log" 2>&1
    rc=$?
    grep -E '^FAIL' "$OUT/fuzz-replay.log" | head -10
    note "fuzz replay (cuda): $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$OUT/fuzz-replay.log" | tail -1); $(grep -E '^replay ' "$OUT/fuzz-replay.log" | tail -1 | sed -E 's/^replay \(cuda\): //') (rc $rc, $(( $(date +%s) - t0 )) s)"
    t0=$(date +%s)
    timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 10 "$BIN/nsa_fuzz_replay" --backend cuda "${FUZZ_IN[@]}" \
        > "$OUT/fuzz-memcheck.log" 2>&1
    rc=$?
    grep -E '^FAIL' "$OUT/fuzz-memcheck.log" | head -10
    note "fuzz replay memcheck: $(grep -E 'ERROR SUMMARY' "$OUT/fuzz-memcheck.log" | tail -1) / $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$OUT/fuzz-memcheck.log" | tail -1) (rc $rc, $(( $(date +%s) - t0 )) s)"
else
    note "fuzz replay: $BIN/nsa_fuzz_replay missing, not run"
fi
fi # fuzz

# fla's test file judges nsa the way it judges fla: its naive references and assert_close, every
# case that calls parallel_nsa; the known gaps are strict xfails (tests/python/fla_swap/).
FLA_TESTS="${NSA_PEERS:-peers}/fla/tests/ops/test_nsa.py"
if want fla; then
if [ -f "$FLA_TESTS" ]; then
    say "fla's NSA tests against nsa.parallel_nsa"
    lib="$BIN/libnsa.so"
    [ -e "$lib" ] || lib=build/libnsa.so
    t0=$(date +%s)
    rm -f "$OUT/fla-suite.txt"
    NSA_LIBRARY="$(cd "$(dirname "$lib")" && pwd)/libnsa.so" NSA_FLA_SUMMARY="$OUT/fla-suite.txt" timeout 900 \
        python3 -m pytest -q -rs tests/python/test_fla_suite.py > "$OUT/fla-suite.log" 2>&1
    rc=$?
    note "fla suite: $(grep -E '^fla cases: ' "$OUT/fla-suite.txt" 2>/dev/null | tail -1 | sed 's/^fla cases: //')" \
        "(pytest rc $rc: $(tail -1 "$OUT/fla-suite.log" | tr -d '='), $(( $(date +%s) - t0 )) s)"
    grep -E '^(FAIL |fla: )' "$OUT/fla-suite.txt" 2>/dev/null | cut -c1-300 | tee -a "$SUMMARY"
    grep -E '^SKIPPED' "$OUT/fla-suite.log" | cut -c1-200 | tee -a "$SUMMARY"
else
    note "fla suite: no $FLA_TESTS, not run (bash scripts/fetch-peers.sh fla, and carry peers/)"
fi
fi # fla

if [ -n "${RACE:-}" ]; then # RACE=1: compute-sanitizer racecheck on small cases (a multi-chunk one included)
    say "racecheck"
    timeout 200 compute-sanitizer --tool racecheck --print-limit 10 "$BIN/nsa_gpu_tests" --no-fork --seed 11 --cases 8 --max-T 600 --no-attention > "$OUT/racecheck.log" 2>&1
    note "racecheck: $(grep -E 'RACECHECK SUMMARY' "$OUT/racecheck.log" | tail -1) / $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$OUT/racecheck.log" | tail -1)"
    NSA_TEST_ATTENTION_QUICK=1 timeout 240 compute-sanitizer --tool racecheck --print-limit 10 "$BIN/nsa_gpu_tests" --no-fork --cases 0 > "$OUT/racecheck-attention.log" 2>&1
    note "racecheck (attention options): $(grep -E 'RACECHECK SUMMARY' "$OUT/racecheck-attention.log" | tail -1) / $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$OUT/racecheck-attention.log" | tail -1)"
fi

if [ -n "${PROFILE:-}" ]; then
    say "ncu profile (T=$PROFILE)"
    timeout 150 ncu --clock-control none -k 'regex:qtile|ktile|select_kernel|gate_kernel|store32|compress|inv_|slc_' \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        "${BENCH[@]}" --T "$PROFILE" --profile > "$OUT/ncu.txt" 2>&1
    note "ncu rc $?: $(grep -c 'Duration' "$OUT/ncu.txt") kernels"
    grep -E '^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall' "$OUT/ncu.txt" | head -120 > "$OUT/ncu-short.txt"
fi

if want bench; then
say "bench"
timeout 180 "${BENCH[@]}" --T "$BENCH_T" --reps "$REPS" > "$OUT/bench.log" 2>&1
note "bench rc $?"
if [ -n "${AB:-}" ]; then # the same bench on the mma.sync forward tile (A/B of the wgmma path)
    NSA_CUDA_WGMMA=0 timeout 180 "${BENCH[@]}" --T "$BENCH_T" --reps "$REPS" > "$OUT/bench-mma.log" 2>&1
    note "bench with NSA_CUDA_WGMMA=0 rc $?:"
    tail -n +2 "$OUT/bench-mma.log" | tee -a "$SUMMARY"
fi
if [ -n "${ENVAB:-}" ]; then # ENVAB="NAME=value ...": the same bench under those switches (A/B of one path)
    env $ENVAB timeout 180 "${BENCH[@]}" --T "$BENCH_T" --reps "$REPS" > "$OUT/bench-envab.log" 2>&1
    note "bench with $ENVAB rc $?:"
    tail -n +2 "$OUT/bench-envab.log" | tee -a "$SUMMARY"
fi
fi # bench
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> "$OUT/gpu.txt" 2>&1

# EXTRA (or FULL=1 = all three): "tables" the benchmark tables (paper config
# 8k..128k, fla config, G = 4 and 1, DK 192 / DV 128: CUDA-event ms per branch), "cli" the
# CLI's per-op tables with TFLOP/s (JSON too), "1m" the 1M-token run checked on sampled rows
# against the float64 reference. Everything lands in $OUT/full.txt and $OUT/full.tgz (the
# results come back as a few files). All three take ~10 minutes: split them
# over calls (EXTRA=tables, then EXTRA="cli 1m").
EXTRA="${EXTRA:-}"
[ -n "${FULL:-}" ] && EXTRA="tables cli 1m"
if [ -n "$EXTRA" ]; then
    FULLDIR="$OUT/full"
    mkdir -p "$FULLDIR"
    say "extra: $EXTRA"
    for part in $EXTRA; do
        case "$part" in
        tables)
            run_bench() { name=$1; shift; timeout 240 "${BENCH[@]}" --reps "$REPS" "$@" > "$FULLDIR/bench-$name.log" 2>&1; note "bench-$name rc $?"; }
            run_bench paper --T 8192,16384,32768,65536,131072
            run_bench fla --config fla --T 8192,16384,32768,65536,131072
            run_bench g4 --HQ 16 --H 4 --T 16384,65536
            run_bench g1 --HQ 8 --H 8 --T 16384,65536
            run_bench d192 --DK 192 --DV 128 --T 16384,65536
            ;;
        cli)
            for cfg in paper fla; do
                timeout 240 "$BIN/nsa" bench --backend cuda --config "$cfg" --HQ 64 --H 4 --D 128 --dtype bf16 --T 16k,64k \
                    --bwd --no-dense --reps 3 --json "$FULLDIR/cli-$cfg.json" > "$FULLDIR/cli-$cfg.txt" 2>&1
                note "cli bench $cfg rc $?"
            done
            ;;
        1m)
            timeout 400 "$BIN/nsa" demo --backend cuda --T 1048576 --rows 256 --no-dense > "$FULLDIR/demo-1m.txt" 2>&1
            note "demo 1M rc $?: $(grep -E 'accuracy|of max' "$FULLDIR/demo-1m.txt" | tr '\n' ' ')"
            ;;
        options) # the cost of each nsa_attention option on the GPU (needs torch)
            NSA_LIBRARY="$(cd "$BIN" && pwd)/libnsa.so" PYTHONPATH=python timeout 300 python3 bench/attn_options_gpu.py \
                > "$FULLDIR/options.txt" 2>&1
            note "options rc $?"
            tail -n +2 "$FULLDIR/options.txt" | tee -a "$SUMMARY"
            ;;
        peers) # nsa beside mdy666 and fla in one process (needs torch, and peers/ carried)
            NSA_LIBRARY="$(cd "$BIN" && pwd)/libnsa.so" timeout 420 python3 bench/peers.py --impl nsa,mdy666,fla --T 16k,64k --G 16,4 \
                --nsa-configs paper,fla --reps 5 --out "$FULLDIR" --tag peers > "$FULLDIR/peers.txt" 2>&1
            note "peers rc $?: $(grep -cE '^(nsa|mdy666|fla) ' "$FULLDIR/peers.txt") rows"
            grep -E '^(nsa|mdy666) .* 64k ' "$FULLDIR/peers.txt" | tee -a "$SUMMARY"
            ;;
        workload) # a trained layer's inputs, their overlap, and nsa beside mdy666 on them (torch; peers/ for mdy666)
            wl_env=(env NSA_LIBRARY="$(cd "$BIN" && pwd)/libnsa.so" PYTHONPATH=python PYTHONUNBUFFERED=1)
            wl_ckpt="$FULLDIR/paper8k.pt" wl_npz="$FULLDIR/workload-layer.npz" wl_T="${WORKLOAD_T:-65536}"
            "${wl_env[@]}" timeout 300 python3 examples/train_tiny.py --seq-len 8192 --batch 4 --steps "${WORKLOAD_STEPS:-800}" \
                --eval-every 200 --nsa-config paper --head-dim 128 --heads 16 --kv-heads 1 --save "$wl_ckpt" \
                --out "$FULLDIR/train" > "$FULLDIR/workload-train.txt" 2>&1
            note "workload: train rc $?: $(grep -E '^(nsa|full) *:' "$FULLDIR/workload-train.txt" | tr '\n' ' ')"
            "${wl_env[@]}" timeout 200 python3 bench/workload.py --checkpoint "$wl_ckpt" --T "$wl_T" \
                --layer "${WORKLOAD_LAYER:-1}" --out "$wl_npz" > "$FULLDIR/workload.txt" 2>&1
            note "workload: layer rc $?: $(tail -1 "$FULLDIR/workload.txt")"
            "${wl_env[@]}" timeout 200 python3 bench/peers.py --workload "$wl_npz" --reps 5 --out "$FULLDIR" --tag peers-workload \
                > "$FULLDIR/workload-peers.txt" 2>&1
            note "workload: peers on the layer rc $?:"
            grep -E '^  (nsa|mdy666) ' "$FULLDIR/workload-peers.txt" | tee -a "$SUMMARY"
            "${wl_env[@]}" timeout 200 python3 bench/peers.py --T "$wl_T" --G 16 --H 1 --impl nsa,mdy666 --nsa-configs paper --reps 5 \
                --out "$FULLDIR" --tag peers-random-g16h1 > "$FULLDIR/workload-random.txt" 2>&1
            note "workload: peers on random inputs of its shapes rc $?:"
            grep -E '^  (nsa|mdy666) ' "$FULLDIR/workload-random.txt" | tee -a "$SUMMARY"
            cp "$FULLDIR"/*-peers-*.json "$FULLDIR"/*-peers-*.png "$FULLDIR"/workload-layer.json "$OUT"/ 2>/dev/null
            cp "$FULLDIR/train/loss.csv" "$OUT/workload-train-loss.csv" 2>/dev/null
            rm -f "$wl_ckpt" "$wl_npz" # large; the scripts that make them are the product
            ;;
        python) # the Python binding's CUDA tests (torch custom ops, KV caches and the step, CUDA
                # graphs, nn module) and the cached generation example on the GPU (needs torch)
            NSA_LIBRARY="$(cd "$BIN" && pwd)/libnsa.so" PYTHONUNBUFFERED=1 timeout 300 python3 -m pytest -q -rs -k "cuda or tiled" \
                tests/python/test_step_gpu.py tests/python/test_step.py tests/python/test_nn.py tests/python/test_torch.py tests/python/test_attention.py \
                tests/python/test_basics.py tests/python/test_flex.py tests/python/test_distributed.py tests/python/test_chunk.py > "$FULLDIR/python-cuda.txt" 2>&1
            note "python cuda tests rc $?: $(tail -1 "$FULLDIR/python-cuda.txt" | tr -d '=')"
            grep -E '^(FAILED|ERROR)' "$FULLDIR/python-cuda.txt" | head -20 | cut -c1-300 | tee -a "$SUMMARY"
            # the tiled steps' kernels under memcheck (a paged NSA step and a paged dense step)
            NSA_LIBRARY="$(cd "$BIN" && pwd)/libnsa.so" timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 10 \
                python3 -m pytest -q -x tests/python/test_step_gpu.py -k "bfloat16 and (128-4-64 or 128-16-64)" \
                > "$FULLDIR/python-memcheck.txt" 2>&1
            note "python step memcheck rc $?: $(grep -E 'ERROR SUMMARY' "$FULLDIR/python-memcheck.txt" | tail -1) / $(tail -1 "$FULLDIR/python-memcheck.txt" | tr -d '=')"
            # the block-sparse kernels (generated: forward and backward, tensor-core and scalar) under memcheck
            NSA_LIBRARY="$(cd "$BIN" && pwd)/libnsa.so" timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 10 \
                python3 -m pytest -q -x -p no:cacheprovider tests/python/test_flex.py -k "cuda and (backward or document or nan)" \
                > "$FULLDIR/python-flex-memcheck.txt" 2>&1
            note "python flex memcheck rc $?: $(grep -E 'ERROR SUMMARY' "$FULLDIR/python-flex-memcheck.txt" | tail -1) / $(tail -1 "$FULLDIR/python-flex-memcheck.txt" | tr -d '=')"
            NSA_LIBRARY="$(cd "$BIN" && pwd)/libnsa.so" PYTHONPATH=python PYTHONUNBUFFERED=1 timeout 240 python3 examples/generate.py \
                --device cuda --tiny --train-steps 60 > "$FULLDIR/generate.txt" 2>&1
            note "generate rc $?: $(grep -iE 'equal|tokens/s|differ' "$FULLDIR/generate.txt" | tr '\n' ' ' | cut -c1-300)"
            ;;
        decode) # one decode step beside mdy666's and dense attention (needs torch; peers/ for mdy666)
            NSA_LIBRARY="$(cd "$BIN" && pwd)/libnsa.so" PYTHONPATH=python PYTHONUNBUFFERED=1 timeout 300 python3 bench/decode.py \
                --batch "${DECODE_B:-1,8,32}" --ctx "${DECODE_CTX:-16k,64k}" --out "$FULLDIR" > "$FULLDIR/decode.txt" 2>&1
            note "decode rc $?:"
            grep -E '^(nsa|mdy666|cudnn|fa2) ' "$FULLDIR/decode.txt" | tee -a "$SUMMARY"
            cp "$FULLDIR"/*-decode*.json "$OUT"/ 2>/dev/null
            NSA_LIBRARY="$(cd "$BIN" && pwd)/libnsa.so" PYTHONPATH=python timeout 200 python3 bench/decode.py --profile --batch 1,32 \
                --ctx 64k --reps 20 > "$FULLDIR/decode-profile.txt" 2>&1
            note "decode profile rc $?:"
            cat "$FULLDIR/decode-profile.txt" | tee -a "$SUMMARY"
            ;;
        flex) # nsa.flex_attention beside torch's compiled FlexAttention (needs torch)
            NSA_LIBRARY="$(cd "$BIN" && pwd)/libnsa.so" PYTHONPATH=python PYTHONUNBUFFERED=1 timeout 420 python3 bench/flex.py \
                --T "${FLEX_T:-16k}" --heads "${FLEX_HEADS:-16/16}" --mods "${FLEX_MODS:-causal,window,document,softcap,prefix,alibi,relbias}" \
                --passes "${FLEX_PASSES:-fwd,fwd+bwd}" --reps "${FLEX_REPS:-20}" --out "$FULLDIR" > "$FULLDIR/flex.txt" 2>&1
            note "flex rc $?:"
            grep -vE '^(#|$)' "$FULLDIR/flex.txt" | tail -30 | tee -a "$SUMMARY"
            # a new mod's first forward and backward: compiled (a fresh kernel cache), then loaded from disk
            NSA_LIBRARY="$(cd "$BIN" && pwd)/libnsa.so" PYTHONPATH=python PYTHONUNBUFFERED=1 timeout 240 python3 bench/flex.py \
                --first-call --T 16k --heads 16/16 --mods "${FLEX_FIRST_MODS:-alibi,relbias,prefix}" --out "$FULLDIR" \
                > "$FULLDIR/flex-first.txt" 2>&1
            note "flex first calls rc $?:"
            tail -8 "$FULLDIR/flex-first.txt" | tee -a "$SUMMARY"
            ;;
        esac
    done
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> "$OUT/gpu.txt" 2>&1
    for f in "$FULLDIR"/*.log "$FULLDIR"/*.txt; do [ -e "$f" ] && { echo "==== $(basename "$f")"; cat "$f"; }; done > "$OUT/full.txt"
    tar czf "$OUT/full.tgz" -C "$OUT" full && rm -rf "$FULLDIR"
fi

echo
echo "================ summary ================"
cat "$SUMMARY"
if [ -f "$OUT/bench.log" ]; then cat "$OUT/bench.log"; fi
