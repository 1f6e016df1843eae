"""The CLI's bench op selection (build/nsa bench --op): the listed ops are timed and written to
the JSON, what they read runs first untimed, unknown names are a usage error (exit 2)."""
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(ROOT, "build", "nsa")
SMALL = ["--backend", "cpu", "--T", "256", "--HQ", "2", "--H", "1", "--D", "16", "--reps", "1", "--threads", "1"]


def bench(tmp_path, *extra):
    if not os.path.exists(CLI):
        pytest.skip("build/nsa not built")
    out = tmp_path / "bench.json"
    r = subprocess.run([CLI, "bench", *SMALL, "--json", str(out), *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text()), r


def test_op_attention_times_window_and_dense_both_passes(tmp_path):
    rows, r = bench(tmp_path, "--op", "attention")
    assert sorted(x["op"] for x in rows) == ["dense", "dense_bwd", "window", "window_bwd"]
    for x in rows:
        assert x["ms"] > 0 and x["gflops"] > 0 and x["backend"] == "cpu"
        assert x["pass"] == ("bwd" if x["op"].endswith("_bwd") else "fwd")
        assert x["impl"] == ("dense" if x["op"].startswith("dense") else "nsa")


def test_op_runs_its_inputs_untimed(tmp_path):
    rows, r = bench(tmp_path, "--op", "slc_attn")
    assert [x["op"] for x in rows] == ["slc_attn"]
    assert "nsa_select (input of a timed op, untimed)" in r.stderr


def test_unknown_op_is_a_usage_error(tmp_path):
    if not os.path.exists(CLI):
        pytest.skip("build/nsa not built")
    r = subprocess.run([CLI, "bench", *SMALL, "--op", "bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown op 'bogus'" in r.stderr
