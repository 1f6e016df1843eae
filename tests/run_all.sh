#!/usr/bin/env bash
# run_all.sh -- the whole CPU test suite, as `make test` runs it: the C suite (build/nsa_tests)
# one group at a time, each announced as it starts ("== C: <group>"; the long random sweep
# prints a progress line every ~10 s), then ptxas's reports of the CUDA build when there is one
# (no tile's wgmma products serialised), then the Python suite (pytest, tests/python) when
# python3 has numpy and pytest, and one combined "N passed, N failed, N skipped" line last.
# Exit code non-zero on any failure.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
B="${B:-build}" # the build folder (make's B); the Python suite loads its libnsa.so
[ "$B" = build ] || export NSA_LIBRARY="${NSA_LIBRARY:-$PWD/$B/libnsa.so}"

c_log="$(mktemp)"; py_log="$(mktemp)"
trap 'rm -f "$c_log" "$py_log"' EXIT

c_pass=0; c_fail=0
groups="$("$B"/nsa_tests --list)" || { echo "build/nsa_tests --list failed"; groups=""; c_fail=1; }
for g in $groups; do
    echo "== C: $g"
    # the group's own total line is left out: the only totals printed are the ones below
    "$B"/nsa_tests --group "$g" 2>&1 | tee "$c_log" | grep --line-buffered -vE '^[0-9]+ passed, [0-9]+ failed$'
    rc=${PIPESTATUS[0]}
    read -r p f < <(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$c_log" | tail -n 1 | sed -E 's/([0-9]+) passed, ([0-9]+) failed/\1 \2/')
    p=${p:-0}; f=${f:-1}
    [ "$rc" -eq 0 ] || [ "$f" -gt 0 ] || f=1 # a crash after the group's counts still fails
    c_pass=$((c_pass + p)); c_fail=$((c_fail + f))
done

# ptxas's reports of the CUDA build (one per unit, kept by the Makefile): a tile whose wgmma
# products ptxas serialised (too few registers, or a product's input registers written inside
# its pipeline stage) still computes the right values at a fraction of its speed, which no
# test on a CPU can see. One check per unit.
reports="$(ls "$B"/obj/src/cuda/*.o.ptxas "$B"/obj/src/cuda/*/*.o.ptxas 2> /dev/null)"
if [ -n "$reports" ]; then
    units=$(ls src/cuda/*.cu src/cuda/*/*.cu 2> /dev/null | wc -l)
    echo "== ptxas: the reports of $(echo "$reports" | wc -l) of $units CUDA units (an object built without one: rebuild it)"
    for r in $reports; do
        if grep -q "are serialized" "$r"; then
            echo "FAIL $r: $(grep -o "serialized due to [^']*'[^']*'" "$r" | sort -u | head -3)"
            c_fail=$((c_fail + 1))
        else
            c_pass=$((c_pass + 1))
        fi
    done
fi

py_pass=0; py_fail=0; py_skip=0
if python3 -c "import numpy, pytest" > /dev/null 2>&1; then
    echo "== python: pytest tests/python"
    python3 -m pytest -q -rs -p no:cacheprovider tests/python 2>&1 | tee "$py_log"
    py_rc=${PIPESTATUS[0]}
    last="$(grep -E '(passed|failed|skipped|error)' "$py_log" | tail -n 1)"
    py_pass=$(echo "$last" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+' || echo 0)
    py_fail=$(( $(echo "$last" | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+' || echo 0) + $(echo "$last" | grep -oE '[0-9]+ errors?' | grep -oE '[0-9]+' || echo 0) ))
    py_skip=$(echo "$last" | grep -oE '[0-9]+ skipped' | grep -oE '[0-9]+' || echo 0)
    [ "$py_rc" -eq 0 ] || [ "$py_fail" -gt 0 ] || py_fail=1
else
    echo "== python: skipped (python3 lacks numpy or pytest: python3 -m pip install numpy pytest)"
    py_skip=1
fi

echo "C: $c_pass passed, $c_fail failed; Python: $py_pass passed, $py_fail failed, $py_skip skipped"
echo "$((c_pass + py_pass)) passed, $((c_fail + py_fail)) failed, $py_skip skipped"
[ $((c_fail + py_fail)) -eq 0 ]
