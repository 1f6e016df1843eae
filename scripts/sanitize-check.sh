#!/usr/bin/env bash
# sanitize-check.sh -- the CPU test suite, the CLI's check and the fuzz inputs' replay
# (build/nsa_fuzz_replay: host memory copied in and out as a device's would be) built with
# AddressSanitizer, UndefinedBehaviorSanitizer and LeakSanitizer, in a build folder of their
# own (the plain build/ is left alone): any report fails the run. CPU backend only (no CUDA).
#
#   bash scripts/sanitize-check.sh            # what `make test-sanitize` and CI run
#   CASES=40 bash scripts/sanitize-check.sh   # a longer CLI check
# The last line is "N passed, N failed".
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SAN_DIR="${SAN_DIR:-$PWD/build-sanitize}"
CASES="${CASES:-12}"
rm -rf "$SAN_DIR"
mkdir -p "$SAN_DIR"
# a copy of the tree, so the sanitized objects never mix with build/ (one configuration per folder)
tar --exclude=./build --exclude=./build-sanitize --exclude=./build-valgrind --exclude=./.git -cf - . | tar -xf - -C "$SAN_DIR"
cd "$SAN_DIR"
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=23" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
echo "== sanitize: build (NSA_CUDA=0, $SAN)"
if ! make -j"$(nproc)" NSA_CUDA=0 NATIVE=0 OPT=-O1 CFLAGS="$SAN" LDLIBS="-fopenmp -lm $SAN" \
    build/nsa_tests build/readme_example build/nsa build/nsa_fuzz_replay > build.log 2>&1; then
    tail -30 build.log
    echo "sanitize: the build failed"
    echo "0 passed, 1 failed"
    exit 1
fi
pass=0; fail=0
# run NAME LOG CMD...: one sanitized program; its counts join the totals (a sanitizer report
# or a crash after the counts still fails)
run() {
    local name=$1 log=$2 rc p f
    shift 2
    echo "== sanitize: $name"
    "$@" > "$log" 2>&1
    rc=$?
    grep -E 'ERROR: |runtime error|SUMMARY: ' "$log" | head -20
    read -r p f < <(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log" | tail -n 1 | sed -E 's/([0-9]+) passed, ([0-9]+) failed/\1 \2/')
    p=${p:-0}; f=${f:-1}
    [ "$rc" -eq 0 ] || [ "$f" -gt 0 ] || f=1
    echo "sanitize: $name $p passed, $f failed (rc $rc)"
    pass=$((pass + p)); fail=$((fail + f))
}
run "C suite" suite.log ./build/nsa_tests
run "nsa check --cases $CASES" check.log ./build/nsa check --backend cpu --cases "$CASES" --seed 20261125
run "fuzz replay" replay.log ./build/nsa_fuzz_replay --backend cpu tests/fuzz/regressions tests/fuzz/corpus
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
