#!/usr/bin/env bash
# fuzz-check.sh -- what `make fuzz-ci` and CI run: build/nsa_fuzz (libFuzzer, ASan + UBSan,
# CPU backend) replays every file of tests/fuzz/regressions and tests/fuzz/corpus, one input
# each, then fuzzes FUZZ_SECONDS from the corpus. Needs clang with libFuzzer (FUZZ_CC).
#
#   bash scripts/fuzz-check.sh                  # FUZZ_SECONDS=180
#   FUZZ_SECONDS=600 bash scripts/fuzz-check.sh
# Counts: each replayed input is one check (a crash or violation stops the replay and is one
# failure), the timed fuzzing is one more. The last line is "N passed, N failed"; a failing
# input is left as build/fuzz/crash-* (copy it to tests/fuzz/regressions once fixed).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FUZZ_SECONDS="${FUZZ_SECONDS:-180}"
echo "== fuzz: build build/nsa_fuzz"
mkdir -p build/fuzz
if ! make build/nsa_fuzz > build/fuzz/build.log 2>&1; then
    tail -30 build/fuzz/build.log
    echo "fuzz: the build failed"
    echo "0 passed, 1 failed"
    exit 1
fi
mkdir -p build/fuzz/corpus
pass=0; fail=0

# The stored inputs as file arguments: libFuzzer runs each once and prints "Executed <file>",
# so the count of those lines is the count that held; it stops at the first failing one.
inputs=()
for f in tests/fuzz/regressions/* tests/fuzz/corpus/*; do [ -f "$f" ] && inputs+=("$f"); done
echo "== fuzz: replay ${#inputs[@]} inputs (tests/fuzz/regressions, tests/fuzz/corpus)"
./build/nsa_fuzz -artifact_prefix=build/fuzz/ "${inputs[@]}" > build/fuzz/replay.log 2>&1
rc=$?
p=$(grep -c '^Executed ' build/fuzz/replay.log)
if [ "$rc" -ne 0 ] || [ "$p" -ne "${#inputs[@]}" ]; then
    grep -E 'fuzz: |ERROR: |runtime error|SUMMARY: |^Running: ' build/fuzz/replay.log | tail -20
    fail=$((fail + 1))
fi
echo "fuzz: replay $p of ${#inputs[@]} inputs held (rc $rc)"
pass=$((pass + p))

echo "== fuzz: ${FUZZ_SECONDS} s from the corpus"
./build/nsa_fuzz -max_total_time="$FUZZ_SECONDS" -max_len=512 -timeout=10 -print_final_stats=1 \
    -artifact_prefix=build/fuzz/ build/fuzz/corpus tests/fuzz/corpus > build/fuzz/fuzz.log 2>&1
rc=$?
grep -E '^stat::number_of_executed_units|^Done ' build/fuzz/fuzz.log
if [ "$rc" -eq 0 ]; then
    pass=$((pass + 1))
else
    grep -E 'fuzz: |ERROR: |runtime error|SUMMARY: |Test unit written' build/fuzz/fuzz.log | tail -20
    fail=$((fail + 1))
fi
echo "fuzz: ${FUZZ_SECONDS} s of fuzzing rc $rc"
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
