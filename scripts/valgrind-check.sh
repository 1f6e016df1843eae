#!/usr/bin/env bash
# valgrind-check.sh -- small runs of the CLI (build/nsa), the README's C example and the fuzz
# replay under valgrind memcheck, built plain (-O2 -g, no -march=native: valgrind does not
# decode every vector extension; CPU backend) in a build folder of their own (build/ is left
# alone). Any memcheck error or definite leak fails the run; what libgomp and the C runtime
# keep until exit ("still reachable") does not.
#
#   bash scripts/valgrind-check.sh          # what `make test-valgrind` and CI run
# Each program run is one check; the last line is "N passed, N failed".
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VG_DIR="${VG_DIR:-$PWD/build-valgrind}"
command -v valgrind > /dev/null 2>&1 || { echo "valgrind-check: valgrind not found"; echo "0 passed, 1 failed"; exit 1; }
rm -rf "$VG_DIR"
mkdir -p "$VG_DIR"
# a copy of the tree, so these objects never mix with build/ (one configuration per folder)
tar --exclude=./build --exclude=./build-sanitize --exclude=./build-valgrind --exclude=./.git -cf - . | tar -xf - -C "$VG_DIR"
cd "$VG_DIR"
echo "== valgrind: build (NSA_CUDA=0 NATIVE=0 OPT=-O2)"
if ! make -j"$(nproc)" NSA_CUDA=0 NATIVE=0 OPT=-O2 build/nsa build/readme_example build/nsa_fuzz_replay > build.log 2>&1; then
    tail -30 build.log
    echo "valgrind-check: the build failed"
    echo "0 passed, 1 failed"
    exit 1
fi
# One OpenMP thread: valgrind runs a program's threads one at a time anyway, so more threads
# only cost time, and with one thread libgomp starts no pool whose thread stacks valgrind
# would list as possibly lost at exit.
export OMP_NUM_THREADS=1
VG=(valgrind -q --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite)
pass=0; fail=0
# run NAME EXPECTED_RC CMD...: one program under memcheck; it passes when the exit code is the
# expected one (memcheck turns an error or a definite leak into 1) and memcheck printed nothing.
run() {
    local name=$1 want=$2 log t0 rc
    shift 2
    log="vg-$((pass + fail)).log"
    t0=$(date +%s)
    "${VG[@]}" "$@" > "$log" 2>&1
    rc=$?
    if [ "$rc" -eq "$want" ] && ! grep -q '^==[0-9]*==' "$log"; then
        pass=$((pass + 1))
        echo "valgrind: ok   $name ($(( $(date +%s) - t0 )) s)"
    else
        fail=$((fail + 1))
        echo "valgrind: FAIL $name (rc $rc, expected $want; $(( $(date +%s) - t0 )) s)"
        grep -E '^==[0-9]*==' "$log" | head -40
        tail -5 "$log"
    fi
}
run "nsa version" 0 ./build/nsa version
run "nsa --help" 0 ./build/nsa --help
run "nsa check --cases (missing value: bad usage)" 2 ./build/nsa check --cases
run "nsa check --cases 4" 0 ./build/nsa check --backend cpu --cases 4 --seed 20261125 --threads 1
run "nsa demo --T 64" 0 ./build/nsa demo --backend cpu --T 64 --rows 4 --threads 1 --no-dense
run "nsa bench --T 64 --bwd" 0 ./build/nsa bench --backend cpu --T 64 --HQ 2 --H 1 --D 32 --reps 1 --threads 1 --bwd
run "readme_example" 0 ./build/readme_example
run "nsa_fuzz_replay (regressions, corpus)" 0 ./build/nsa_fuzz_replay --backend cpu tests/fuzz/regressions tests/fuzz/corpus
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
